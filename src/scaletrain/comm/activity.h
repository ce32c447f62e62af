#pragma once
// Whether this process is blocked in a collective right now. A rank that
// waits for its peers is alive even though it makes no progress, unlike a
// peer that was stopped or is stuck computing: the trainer's heartbeat thread
// beats for it while this is non-zero (launch::heartbeat(), Note [Heartbeats]
// in train/loop.cpp), so the launcher's watchdog kills the rank that
// really stopped, not the ones waiting for it.
namespace scaletrain::comm {

// Threads of this process inside Work::wait() (group.cpp keeps the count).
int collectives_waiting();

}  // namespace scaletrain::comm

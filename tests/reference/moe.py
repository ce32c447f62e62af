#!/usr/bin/env python3
"""Reference of scaletrain's MoE routing: top-k choice, capacity dropping, auxiliary losses.

Plain Python floats (IEEE double) and explicit loops over sequences, tokens and slots;
no torch. The definitions are the project's (Note [MoE routing] in src/scaletrain/models/moe.h), spelled out here:

  route IN_JSON OUT_JSON
      IN_JSON: {"logits": [[E floats] per token, N rows], "seq_len": T, "k": k,
                "capacity_factor": cf (0 = dropless), "drop_policy": "probs" | "position"}
      OUT_JSON: {"experts": [[k ints] per token], "weights": [[k floats] per token],
                 "kept": [[k bools] per token], "aux": float, "z": float,
                 "tokens_per_expert": [E ints], "dropped": int, "capacity": C (0 when dropless)}
      Exit 1 with a one-line message on bad input (N not a multiple of T, k outside 1..E,
      ragged or non-finite logits, unknown drop_policy, ...).
  selftest
      Hand-checkable cases (see selftest()) and invariants on random inputs.

Definitions:
  - probs = softmax(logits) per token. A token takes its k most probable experts, most
    probable first; exactly equal probabilities: the lower expert index first.
    weights = those k probabilities divided by their sum.
  - The N tokens are N/T sequences of T consecutive tokens; capacity and the
    load-balancing loss are per sequence.
  - Capacity (capacity_factor > 0): C = ceil(capacity_factor * T * k / E), evaluated left to
    right in double. A sequence's slots are (t, j), t in 0..T-1, j in 0..k-1, in the order
    t*k + j. Each expert keeps at most C of the slots routed to it:
      "position": the first C in slot order (earliest tokens first);
      "probs": ordered by the slot's router probability (probs[token][expert], not the
               renormalized weight), highest first, equal ones in slot order; the first C.
    The others are dropped (kept = false). Dropless: every slot is kept.
  - aux per sequence = E * sum_i f_i * P_i, f_i = (slots of the sequence routed to expert i,
    counted before dropping) / (T*k), P_i = mean over the sequence's T tokens of probs[.][i];
    "aux" = the mean over sequences.
  - z = mean over the N tokens of logsumexp(logits[token])^2.
  - tokens_per_expert[i] = kept slots routed to expert i (all N tokens); dropped = slots not kept.
"""
import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile

sys.dont_write_bytecode = True  # no __pycache__ in the source tree when tests run us

POLICIES = ("probs", "position")


def logsumexp(row):
    m = max(row)
    return m + math.log(sum(math.exp(v - m) for v in row))


def softmax(row):
    m = max(row)
    e = [math.exp(v - m) for v in row]
    s = sum(e)
    return [v / s for v in e]


def top_k(probs, k):
    """The k most probable expert indices, most probable first, lower index first on a tie."""
    return sorted(range(len(probs)), key=lambda i: (-probs[i], i))[:k]


def capacity(capacity_factor, T, k, E):
    return math.ceil(capacity_factor * T * k / E) if capacity_factor > 0 else 0


def route(logits, T, k, capacity_factor, drop_policy):
    N, E = len(logits), len(logits[0])
    probs = [softmax(row) for row in logits]
    experts, weights, kept = [], [], []
    for p in probs:
        chosen = top_k(p, k)
        total = sum(p[i] for i in chosen)
        experts.append(chosen)
        weights.append([p[i] / total for i in chosen])
        kept.append([True] * k)
    C = capacity(capacity_factor, T, k, E)
    aux_per_seq = []
    for s in range(N // T):
        first = s * T  # the sequence's tokens are first .. first + T - 1
        # load balancing, counted before dropping
        count = [0] * E
        for t in range(T):
            for j in range(k):
                count[experts[first + t][j]] += 1
        aux = 0.0
        for i in range(E):
            f = count[i] / (T * k)
            P = sum(probs[first + t][i] for t in range(T)) / T
            aux += f * P
        aux_per_seq.append(E * aux)
        if C == 0:
            continue
        # capacity: per expert, its slots (t, j) in slot order t*k + j, then the policy's order
        for i in range(E):
            slots = [(t, j) for t in range(T) for j in range(k) if experts[first + t][j] == i]
            if drop_policy == "probs":
                slots = sorted(slots, key=lambda tj: (-probs[first + tj[0]][i], tj[0] * k + tj[1]))
            for t, j in slots[C:]:
                kept[first + t][j] = False
    tokens_per_expert = [0] * E
    dropped = 0
    for n in range(N):
        for j in range(k):
            if kept[n][j]:
                tokens_per_expert[experts[n][j]] += 1
            else:
                dropped += 1
    z = sum(logsumexp(row) ** 2 for row in logits) / N
    return {"experts": experts, "weights": weights, "kept": kept, "aux": sum(aux_per_seq) / len(aux_per_seq),
            "z": z, "tokens_per_expert": tokens_per_expert, "dropped": dropped, "capacity": C}


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v):
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def parse_input(d):
    """(logits, T, k, capacity_factor, drop_policy) from the IN_JSON dict; ValueError on bad input."""
    if not isinstance(d, dict):
        raise ValueError("expected a JSON object")
    for key in ("logits", "seq_len", "k", "capacity_factor", "drop_policy"):
        if key not in d:
            raise ValueError("missing key %r" % key)
    logits = d["logits"]
    if not isinstance(logits, list) or not logits or not all(isinstance(r, list) and r for r in logits):
        raise ValueError("logits must be a non-empty list of non-empty lists")
    E = len(logits[0])
    if any(len(r) != E for r in logits):
        raise ValueError("logits rows have different lengths")
    if not all(_is_num(v) for r in logits for v in r):
        raise ValueError("logits must be finite numbers")
    T, k, cf, policy = d["seq_len"], d["k"], d["capacity_factor"], d["drop_policy"]
    if not _is_int(T) or T < 1 or len(logits) % T:
        raise ValueError("seq_len %r does not divide the %d tokens" % (T, len(logits)))
    if not _is_int(k) or not 1 <= k <= E:
        raise ValueError("k = %r outside 1..%d" % (k, E))
    if not _is_num(cf) or cf < 0:
        raise ValueError("capacity_factor %r must be a number >= 0" % (cf,))
    if policy not in POLICIES:
        raise ValueError("drop_policy %r (expected probs or position)" % (policy,))
    return [[float(v) for v in r] for r in logits], T, k, float(cf), policy


def cmd_route(in_path, out_path):
    try:
        with open(in_path) as f:
            args = parse_input(json.load(f))
    except (ValueError, OSError) as e:  # json.JSONDecodeError is a ValueError
        sys.stderr.write("moe: %s: %s\n" % (in_path, str(e).replace("\n", " ")))
        return 1
    with open(out_path, "w") as f:
        json.dump(route(*args), f)
    return 0


# ---------------------------------------------------------------------------- selftest

def selftest():
    ok = True

    def check(cond, what):
        nonlocal ok
        print(("ok   " if cond else "FAIL ") + what)
        ok = ok and bool(cond)

    def near(a, b, tol=1e-12):
        return abs(a - b) <= tol

    ln = math.log
    # All-zero logits: every probability 1/E, ties -> experts 0..k-1, weights 1/k, aux 1, z = (ln E)^2.
    r = route([[0.0] * 4 for _ in range(6)], 3, 2, 0, "probs")
    check(r["experts"] == [[0, 1]] * 6 and all(near(w, 0.5) for ws in r["weights"] for w in ws)
          and near(r["aux"], 1.0) and near(r["z"], ln(4) ** 2) and r["tokens_per_expert"] == [6, 6, 0, 0]
          and r["dropped"] == 0, "zero logits (E=4, k=2): experts [0, 1] (ties: lower index), weights 1/2, "
          "aux = 1 (P_i = 1/E), z = (ln 4)^2 = %.6f" % r["z"])
    # Balanced assignment (f_i = 1/E) with arbitrary probabilities: aux = sum_i P_i = 1.
    big = [[5.0 if i == t else 0.3 * i for i in range(4)] for t in range(4)]
    r = route(big, 4, 1, 0, "probs")
    check(r["experts"] == [[0], [1], [2], [3]] and near(r["aux"], 1.0),
          "one token per expert (E=4, k=1): aux = E * sum (1/E) P_i = 1: %.15f" % r["aux"])
    # Collapsed routing: every token to expert 0 with probability 3/4: aux = 2 * 1 * 3/4 = 1.5.
    r = route([[ln(3), 0.0]] * 4, 4, 1, 0, "probs")
    check(near(r["aux"], 1.5) and r["tokens_per_expert"] == [4, 0],
          "all tokens on expert 0, p = 3/4 (E=2, k=1): aux = 1.5: %.15f" % r["aux"])
    # Renormalized weights: probabilities 0.4, 0.3, 0.2, 0.1, k = 2 -> experts 0, 1, weights 4/7, 3/7.
    r = route([[ln(0.1), ln(0.3), ln(0.4), ln(0.2)]], 1, 2, 0, "probs")
    check(r["experts"] == [[2, 1]] and near(r["weights"][0][0], 4 / 7) and near(r["weights"][0][1], 3 / 7),
          "probs (0.1, 0.3, 0.4, 0.2), k=2: experts [2, 1] (most probable first), weights 4/7, 3/7")
    # z-loss: logits (a, a) -> logsumexp = a + ln 2; two tokens -> the mean of the squares.
    r = route([[1.0, 1.0], [-2.0, -2.0]], 1, 1, 0, "probs")
    check(near(r["z"], ((1 + ln(2)) ** 2 + (-2 + ln(2)) ** 2) / 2),
          "z of (1, 1) and (-2, -2): mean of (1 + ln 2)^2 and (-2 + ln 2)^2 = %.6f" % r["z"])
    # Capacity, E=2, k=1, T=4, cf=0.5: C = ceil(0.5*4*1/2) = 1. Tokens 0, 1, 2 choose expert 0 with
    # p = 0.6, 0.9, 0.7; token 3 chooses expert 1 (p = 0.8).
    lg = [[ln(0.6), ln(0.4)], [ln(0.9), ln(0.1)], [ln(0.7), ln(0.3)], [ln(0.2), ln(0.8)]]
    rp, rq = route(lg, 4, 1, 0.5, "position"), route(lg, 4, 1, 0.5, "probs")
    check(rp["capacity"] == 1 and rp["kept"] == [[True], [False], [False], [True]] and rp["dropped"] == 2
          and rp["tokens_per_expert"] == [1, 1],
          "capacity 1, position: expert 0 keeps token 0 (earliest), drops 1 and 2; token 3 kept")
    check(rq["kept"] == [[False], [True], [False], [True]] and rq["dropped"] == 2 and rq["tokens_per_expert"] == [1, 1],
          "capacity 1, probs: expert 0 keeps token 1 (p 0.9 > 0.7 > 0.6), drops 0 and 2; token 3 kept")
    check(near(rp["aux"], 2 * (0.75 * (0.6 + 0.9 + 0.7 + 0.2) / 4 + 0.25 * (0.4 + 0.1 + 0.3 + 0.8) / 4))
          and rp["aux"] == rq["aux"] and rp["experts"] == rq["experts"] and rp["weights"] == [[1.0]] * 4,
          "capacity case: aux counts slots before dropping (f = 3/4, 1/4): %.6f; k=1 weights 1" % rp["aux"])
    # Equal probabilities under "probs": the earlier slot wins.
    tie = [[ln(0.9), ln(0.1)], [ln(0.6), ln(0.4)], [ln(0.9), ln(0.1)], [ln(0.2), ln(0.8)]]
    r = route(tie, 4, 1, 0.5, "probs")
    check(r["kept"] == [[True], [False], [False], [True]],
          "probs, tokens 0 and 2 both 0.9 for expert 0: token 0 (earlier slot) kept")
    # k = 2, E = 2, T = 2, cf = 0.5: C = ceil(0.5*2*2/2) = 1. Token 0: probs (0.7, 0.3) -> slots
    # 0 -> e0, 1 -> e1; token 1: (0.2, 0.8) -> slots 2 -> e1, 3 -> e0.
    lg2 = [[ln(0.7), ln(0.3)], [ln(0.2), ln(0.8)]]
    rp, rq = route(lg2, 2, 2, 0.5, "position"), route(lg2, 2, 2, 0.5, "probs")
    check(rp["experts"] == [[0, 1], [1, 0]] and rp["kept"] == [[True, True], [False, False]]
          and rp["tokens_per_expert"] == [1, 1] and rp["dropped"] == 2,
          "k=2, capacity 1, position: token 0's slots 0 (e0) and 1 (e1) kept, token 1's slots 2, 3 dropped")
    check(rq["kept"] == [[True, False], [True, False]] and rq["tokens_per_expert"] == [1, 1],
          "k=2, capacity 1, probs: e0 keeps token 0 (0.7 > 0.2), e1 keeps token 1 (0.8 > 0.3)")
    # Per sequence: two sequences of T=2 (cf 0.5 -> C = 1); sequence 0 sends both tokens to expert 0,
    # sequence 1 one token to each. Capacity only drops in sequence 0; aux = mean of the two.
    lg3 = [[ln(0.75), ln(0.25)], [ln(0.75), ln(0.25)], [ln(0.75), ln(0.25)], [ln(0.25), ln(0.75)]]
    r = route(lg3, 2, 1, 0.5, "position")
    aux0, aux1 = 2 * (1.0 * 0.75 + 0.0 * 0.25), 2 * (0.5 * 0.5 + 0.5 * 0.5)
    whole = route(lg3, 4, 1, 0, "position")["aux"]  # one sequence of 4 instead
    check(r["kept"] == [[True], [False], [True], [True]] and near(r["aux"], (aux0 + aux1) / 2)
          and near(whole, 2 * (0.75 * 0.625 + 0.25 * 0.375)),
          "two sequences of 2: capacity per sequence (only token 1 dropped), aux = mean(1.5, 1) = 1.25, "
          "as one sequence of 4: %.4f" % whole)
    # Capacity rounding up: cf 1.0, T 3, k 1, E 2 -> ceil(1.5) = 2; cf 1.25, T 8, k 2, E 4 -> 5.
    check(capacity(1.0, 3, 1, 2) == 2 and capacity(1.25, 8, 2, 4) == 5 and capacity(0, 8, 2, 4) == 0,
          "capacity: ceil(1.0*3*1/2) = 2, ceil(1.25*8*2/4) = 5, 0 = dropless")
    # Invariants on random inputs.
    rng = random.Random(7)
    inv = True
    for _ in range(200):
        E, T = rng.randint(1, 6), rng.randint(1, 6)
        k = rng.randint(1, E)
        N = T * rng.randint(1, 3)
        lg = [[rng.choice([rng.gauss(0, 2), float(rng.randint(-1, 1))]) for _ in range(E)] for _ in range(N)]
        cf = rng.choice([0, 0.25, 0.5, 1.0, 1.5, 3.0])
        for pol in POLICIES:
            r = route(lg, T, k, cf, pol)
            C = r["capacity"]
            inv &= sum(r["tokens_per_expert"]) + r["dropped"] == N * k
            inv &= all(near(sum(w), 1.0, 1e-12) and len(set(e)) == k for w, e in zip(r["weights"], r["experts"]))
            if cf == 0:
                inv &= r["dropped"] == 0
            for s in range(N // T):
                for i in range(E):
                    slots = [(t, j) for t in range(s * T, s * T + T) for j in range(k) if r["experts"][t][j] == i]
                    kept = [r["kept"][t][j] for t, j in slots]
                    inv &= sum(kept) == (len(slots) if C == 0 else min(C, len(slots)))
                    if pol == "position":
                        inv &= kept == sorted(kept, reverse=True)  # a prefix in slot order
                    else:
                        pk = [softmax(lg[t])[i] for (t, j), kp in zip(slots, kept) if kp]
                        pd = [softmax(lg[t])[i] for (t, j), kp in zip(slots, kept) if not kp]
                        inv &= not pk or not pd or min(pk) >= max(pd)
            inv &= r["aux"] >= 0 and near(r["z"], sum(logsumexp(x) ** 2 for x in lg) / N)
    check(inv, "200 random cases: kept + dropped = N*k, weights sum 1, per expert and sequence min(C, routed) "
          "kept, position keeps a prefix, probs keeps the most probable")
    # The command line: a good file, and bad input -> one line on stderr, exit 1.
    tmp = tempfile.mkdtemp(prefix="moe_selftest_")
    try:
        me = os.path.abspath(__file__)
        good = {"logits": lg2, "seq_len": 2, "k": 2, "capacity_factor": 0.5, "drop_policy": "probs"}
        cases = [good, dict(good, seq_len=3), dict(good, k=3), dict(good, drop_policy="random"),
                 dict(good, logits=[[0.0, 1.0], [0.0]]), dict(good, capacity_factor=-1)]
        results = []
        for n, case in enumerate(cases):
            pin, pout = os.path.join(tmp, "in%d.json" % n), os.path.join(tmp, "out%d.json" % n)
            with open(pin, "w") as f:
                json.dump(case, f)
            p = subprocess.run([sys.executable, me, "route", pin, pout], capture_output=True, text=True)
            if n == 0:
                with open(pout) as f:
                    out = json.load(f)
                results.append(p.returncode == 0 and out["kept"] == rq["kept"] and out["experts"] == rq["experts"])
            else:
                results.append(p.returncode == 1 and p.stderr.count("\n") == 1 and p.stderr.startswith("moe: "))
        check(all(results), "route command: good input written; seq_len 3 of 2 tokens, k 3 of 2 experts, drop_policy "
              "random, ragged logits, capacity_factor -1: one line, exit 1 (%s)" % results)
    finally:
        for fn in os.listdir(tmp):
            os.remove(os.path.join(tmp, fn))
        os.rmdir(tmp)
    print("selftest: " + ("PASS" if ok else "FAIL"))
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    ro = sub.add_parser("route")
    ro.add_argument("in_json")
    ro.add_argument("out_json")
    sub.add_parser("selftest")
    a = ap.parse_args()
    return cmd_route(a.in_json, a.out_json) if a.cmd == "route" else selftest()


if __name__ == "__main__":
    sys.exit(main())

// Layout search. See planner.h.
//
// The search space is small (divisors of the world size x 5 sharding modes x
// 6 activation variants x 3 offload choices), so it is enumerated exhaustively
// with the same estimate_rank the single-layout report uses: the planner can
// never disagree with `estimate-memory --tp .. --pp ..` for the layout it lists.
#include "scaletrain/estimate/planner.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <utility>

#include "scaletrain/util/error.h"

namespace scaletrain::estimate {
namespace {

std::vector<int64_t> divisors(int64_t n) {
  std::vector<int64_t> d;
  for (int64_t i = 1; i <= n; ++i)
    if (n % i == 0) d.push_back(i);
  return d;
}

int recompute_rank(Recompute r) { return r == Recompute::kNone ? 0 : r == Recompute::kSelective ? 1 : 2; }

}  // namespace

std::vector<PlanRow> plan(const ModelSpec& spec, const PlanOptions& o) {
  // Validate what the user fixed (world vs nodes) once, loudly.
  {
    Layout probe = o.base;
    probe.tp = probe.pp = 1;
    probe.sharding = Sharding::kNone;
    probe.sequence_parallel = false;
    probe.offload_params = false;
    probe.lora_rank = spec.shapeless() ? 0 : probe.lora_rank;
    validate_layout(spec, probe);
  }
  const bool raw = spec.shapeless();
  const int64_t world = o.base.world_size, gpn = o.base.gpus_per_node;
  const int64_t nodes = gpn > 0 ? world / gpn : 1;
  const int64_t max_tp = o.max_tp > 0 ? o.max_tp : (gpn > 0 ? gpn : world);
  const std::vector<std::pair<Recompute, bool>> activation_variants = {
      {Recompute::kNone, false},      {Recompute::kNone, true}, {Recompute::kSelective, false},
      {Recompute::kSelective, true},  {Recompute::kFull, false}, {Recompute::kFull, true}};
  struct Offload {
    bool optimizer, params;
  };
  std::vector<Offload> offloads = {{false, false}};
  if (o.try_offload) offloads.insert(offloads.end(), {{true, false}, {true, true}});

  std::vector<PlanRow> rows;
  for (int64_t tp : divisors(world)) {
    if (tp > max_tp || (raw && tp > 1)) continue;
    for (int64_t pp : divisors(world / tp)) {
      if (raw && pp > 1) continue;
      if (pp > 1 && o.base.microbatches < pp) continue;  // bubble (p-1)/m of 50% or more: never worth it
      const int64_t dp = world / (tp * pp);
      for (Sharding sh : {Sharding::kNone, Sharding::kZero1, Sharding::kZero2, Sharding::kZero3, Sharding::kHybrid}) {
        if (dp == 1 && sh != Sharding::kNone) continue;  // nothing to shard over: same as DDP
        if (sh == Sharding::kHybrid && (nodes < 2 || gpn / tp >= dp)) continue;  // hybrid == full shard
        for (Offload off : offloads) {
          if (off.params && sh != Sharding::kZero3 && sh != Sharding::kHybrid) continue;
          for (auto [rc, sp] : activation_variants) {
            if (sp && tp == 1) continue;
            if (raw && (rc != Recompute::kNone || sp)) continue;
            Layout l = o.base;
            l.tp = tp;
            l.pp = pp;
            l.sharding = sh;
            l.offload_optimizer = off.optimizer;
            l.offload_params = off.params;
            l.recompute = rc;
            l.sequence_parallel = sp;
            RankEstimate e;
            try {
              e = estimate_rank(spec, l);
            } catch (const UsageError&) {
              break;  // this (tp, pp) is impossible for the model; no variant will do
            }
            if (e.total <= o.budget_bytes) {
              rows.push_back({l, e});
              break;  // least recomputation that fits
            }
          }
        }
      }
    }
  }
  std::stable_sort(rows.begin(), rows.end(), [](const PlanRow& a, const PlanRow& b) {
    if (a.estimate.comm_seconds != b.estimate.comm_seconds) return a.estimate.comm_seconds < b.estimate.comm_seconds;
    const int ra = recompute_rank(a.layout.recompute), rb = recompute_rank(b.layout.recompute);
    if (ra != rb) return ra < rb;
    if (a.layout.offload_optimizer != b.layout.offload_optimizer) return !a.layout.offload_optimizer;
    return a.estimate.total < b.estimate.total;
  });
  if (o.max_rows > 0 && rows.size() > o.max_rows) rows.resize(o.max_rows);
  return rows;
}

double parse_memory_size(const std::string& text) {
  std::string t;
  for (char c : text)
    if (!std::isspace(static_cast<unsigned char>(c))) t += c;
  size_t pos = 0;
  while (pos < t.size() && (std::isdigit(static_cast<unsigned char>(t[pos])) || t[pos] == '.')) ++pos;
  const std::string number = t.substr(0, pos), unit = t.substr(pos);
  char* end = nullptr;
  const double v = std::strtod(number.c_str(), &end);
  if (number.empty() || end != number.c_str() + number.size() || !(v > 0))
    throw UsageError("bad memory size '" + text + "' (expected e.g. 80GB, 80GiB, 512MB)");
  std::string u;
  for (char c : unit) u += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  // Decimal units as Accelerate's convert_file_size_to_int reads them; binary with "i".
  if (u.empty() || u == "GB" || u == "G") return v * 1e9;
  if (u == "MB" || u == "M") return v * 1e6;
  if (u == "TB" || u == "T") return v * 1e12;
  if (u == "GIB") return v * (1LL << 30);
  if (u == "MIB") return v * (1LL << 20);
  if (u == "TIB") return v * static_cast<double>(1LL << 40);
  throw UsageError("bad memory size '" + text + "' (expected e.g. 80GB, 80GiB, 512MB)");
}

}  // namespace scaletrain::estimate

// Tables and JSON for the estimator (report.h), and the names and one-line
// description of a layout (memory_model.h).
#include "scaletrain/estimate/report.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

namespace scaletrain::estimate {
namespace {

std::string repeat(const char* s, size_t n) {
  std::string out;
  for (size_t i = 0; i < n; ++i) out += s;
  return out;
}

std::string accel_cell(double bytes) { return bytes < 0 ? "N/A" : convert_bytes(bytes); }

}  // namespace

std::string box_table(const std::vector<std::string>& headers, const std::vector<std::vector<std::string>>& rows,
                      const std::string& title) {
  const size_t n = headers.size();
  std::vector<size_t> width(n);
  for (size_t i = 0; i < n; ++i) {
    width[i] = headers[i].size();
    for (const auto& r : rows) width[i] = std::max(width[i], r[i].size());
  }
  size_t sum = 0;
  for (size_t w : width) sum += w;
  // Accelerate's quirk, kept so its table comes out identical: a title wider
  // than the columns widens the last column by the gap to the separator
  // length, once for the rules and once more for the cells.
  size_t diff = 0;
  const size_t sep_len = sum + (n - 1) + 2;
  if (title.size() > sum) {
    diff = title.size() > sep_len ? title.size() - sep_len : sep_len - title.size();
    width[n - 1] += diff;
  }
  auto rule = [&](const char* l, const char* m, const char* r) {
    std::string s = l;
    for (size_t i = 0; i < n; ++i) s += (i ? m : "") + repeat("─", width[i]);
    return s + repeat("─", diff) + r;
  };
  const std::string separator = rule("├", "┼", "┤");
  const size_t inner = sum + diff + diff + (n - 1);  // visible width between the outer bars
  // An empty title gives a plain box (our own tables print their title above).
  std::string out = title.empty() ? rule("┌", "┬", "┐") + "\n"
                                  : rule("┌", "─", "┐") + "\n│" + center(title, inner) + "│\n" + rule("├", "┬", "┤") + "\n";
  width[n - 1] += diff;
  auto line = [&](const std::vector<std::string>& cells) {
    std::string s = "│";
    for (size_t i = 0; i < n; ++i) s += (i ? "│" : "") + center(cells[i], width[i]);
    return s + "│\n";
  };
  out += line(headers) + separator + "\n";
  for (const auto& r : rows) out += line(r);
  std::string bottom = "└";
  for (size_t i = 0; i < n; ++i) bottom += (i ? "┴" : "") + repeat("─", width[i]);
  return out + bottom + "┘\n";
}

std::string human_bytes(double bytes) {
  static const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 5) {
    bytes /= 1024.0;
    ++u;
  }
  char buf[64];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", bytes, units[u]);
  return buf;
}

std::string human_count(double n) {
  char buf[64];
  if (n >= 1e9) std::snprintf(buf, sizeof buf, "%.2fB", n / 1e9);
  else if (n >= 1e6) std::snprintf(buf, sizeof buf, "%.2fM", n / 1e6);
  else if (n >= 1e3) std::snprintf(buf, sizeof buf, "%.2fK", n / 1e3);
  else std::snprintf(buf, sizeof buf, "%.0f", n);
  return buf;
}

// ---- Accelerate -------------------------------------------------------------

std::string render_accelerate(const std::string& model, const std::vector<AccelerateRow>& rows) {
  std::vector<std::vector<std::string>> main, stages;
  for (const auto& r : rows) {
    main.push_back({accel_dtype_name(r.dtype), convert_bytes(r.largest_layer_bytes), convert_bytes(r.total_bytes),
                    accel_cell(r.highest_bytes)});
    stages.push_back({accel_dtype_name(r.dtype), accel_cell(r.model_bytes), accel_cell(r.gradients_bytes),
                      accel_cell(r.optimizer_bytes), accel_cell(r.step_bytes), accel_cell(r.highest_bytes)});
  }
  return box_table({"dtype", "Largest Layer", "Total Size", "Training using Adam"}, main,
                   "Memory Usage for loading `" + model + "`") +
         box_table({"dtype", "Model", "Gradients", "Backward pass", "Optimizer step", "Highest"}, stages,
                   "Training using Adam (batch size 1), by stage");
}

nlohmann::json accelerate_json(const std::string& model, const ParamCounts& counts,
                               const std::vector<AccelerateRow>& rows) {
  nlohmann::json out = {{"method", "accelerate"}, {"model", model}, {"params", counts.base_model},
                        {"buffer_bytes", counts.buffer_bytes}, {"rows", nlohmann::json::array()}};
  for (const auto& r : rows) {
    nlohmann::json training = nullptr;
    if (r.highest_bytes >= 0)
      training = {{"model", r.model_bytes}, {"gradients", r.gradients_bytes}, {"backward_pass", r.optimizer_bytes},
                  {"optimizer_step", r.step_bytes}, {"highest", r.highest_bytes}};
    out["rows"].push_back(
        {{"dtype", accel_dtype_name(r.dtype)},
         {"largest_layer_bytes", r.largest_layer_bytes},
         {"total_bytes", r.total_bytes},
         {"training_bytes", training},
         {"text",
          {{"Largest Layer", convert_bytes(r.largest_layer_bytes)}, {"Total Size", convert_bytes(r.total_bytes)},
           {"Training using Adam", accel_cell(r.highest_bytes)}, {"Model", accel_cell(r.model_bytes)},
           {"Gradients", accel_cell(r.gradients_bytes)}, {"Backward pass", accel_cell(r.optimizer_bytes)},
           {"Optimizer step", accel_cell(r.step_bytes)}, {"Highest", accel_cell(r.highest_bytes)}}}});
  }
  return out;
}

// ---- DeepSpeed --------------------------------------------------------------

namespace {

std::string deepspeed_line(const DeepSpeedRow& r) {
  // f" {cpu_mem / 2 ** 30:7.2f}GB | {gpu_mem / 2 ** 30:6.2f}GB | {options}"
  return " " + fixed2(static_cast<double>(r.cpu_bytes) / (1LL << 30), 7) + "GB | " +
         fixed2(static_cast<double>(r.gpu_bytes) / (1LL << 30), 6) + "GB | " + r.options + "\n";
}

}  // namespace

std::string render_deepspeed(int64_t P, int64_t Lp, const DeepSpeedOptions& o, const std::vector<DeepSpeedRow>& rows) {
  const std::string hw = "HW: Setup with " + std::to_string(o.num_nodes) + (o.num_nodes > 1 ? " nodes, " : " node, ") +
                         std::to_string(o.gpus_per_node) + (o.gpus_per_node > 1 ? " GPUs" : " GPU") + " per node.\n";
  const std::string head = "Estimated memory needed for params, optim states and gradients for a:\n" + hw;
  const std::string millions = std::to_string(static_cast<int64_t>(static_cast<double>(P) / 1e6));
  std::string out = "ZeRO-2 (estimate_zero2_model_states_mem_needs)\n" + head + "SW: Model with " + millions +
                    "M total params.\n  per CPU  |  per GPU |   Options\n";
  for (const auto& r : rows)
    if (r.stage == 2) out += deepspeed_line(r);
  out += "\nZeRO-3 (estimate_zero3_model_states_mem_needs)\n" + head + "SW: Model with " + millions +
         "M total params, " + std::to_string(static_cast<int64_t>(static_cast<double>(Lp) / 1e6)) +
         "M largest layer params.\n  per CPU  |  per GPU |   Options\n";
  for (const auto& r : rows)
    if (r.stage == 3) out += deepspeed_line(r);
  return out;
}

nlohmann::json deepspeed_json(const std::string& model, int64_t P, int64_t Lp, const DeepSpeedOptions& o,
                              const std::vector<DeepSpeedRow>& rows) {
  nlohmann::json out = {{"method", "deepspeed"},
                        {"model", model},
                        {"total_params", P},
                        {"largest_layer_params", Lp},
                        {"num_nodes", o.num_nodes},
                        {"gpus_per_node", o.gpus_per_node},
                        {"additional_buffer_factor", o.additional_buffer_factor},
                        {"rows", nlohmann::json::array()}};
  for (const auto& r : rows)
    out["rows"].push_back({{"stage", r.stage},
                           {"offload_optimizer", r.offload_optimizer},
                           {"offload_param", r.offload_param},
                           {"zero_init", r.zero_init},
                           {"cpu_bytes", r.cpu_bytes},
                           {"gpu_bytes", r.gpu_bytes},
                           {"cpu_gb", fixed2(static_cast<double>(r.cpu_bytes) / (1LL << 30))},
                           {"gpu_gb", fixed2(static_cast<double>(r.gpu_bytes) / (1LL << 30))},
                           {"options", r.options}});
  return out;
}

// ---- scaletrain -------------------------------------------------------------

namespace {

// (label, JSON key, value) of every per-rank figure, in table order.
std::vector<std::tuple<std::string, std::string, double>> rank_figures(const RankEstimate& e) {
  return {{"parameters", "params", e.params},
          {"gradients", "gradients", e.gradients},
          {"fp32 master weights", "master", e.master},
          {"optimizer states", "optimizer", e.optimizer},
          {"gathered units / casts", "gathered", e.gathered},
          {"gradient buckets", "comm_buffers", e.comm_buffers},
          {"activations", "activations", e.activations},
          {"backward workspace", "workspace", e.workspace},
          {"total (peak)", "total", e.total},
          {"host (offloaded)", "host", e.host},
          {"dp traffic / step", "dp_comm_bytes", e.dp_comm_bytes},
          {"tp traffic / step", "tp_comm_bytes", e.tp_comm_bytes},
          {"cp traffic / step", "cp_comm_bytes", e.cp_comm_bytes},
          {"pp traffic / step", "pp_comm_bytes", e.pp_comm_bytes}};
}

std::string seconds_text(double s) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.1f ms", s * 1e3);
  return buf;
}

}  // namespace

std::string render_rank(const ModelSpec& spec, const ParamCounts& counts, const Layout& l, const RankEstimate& e) {
  std::vector<std::vector<std::string>> rows;
  for (const auto& [label, key, value] : rank_figures(e)) rows.push_back({label, human_bytes(value)});
  rows.push_back({"comm time / step", seconds_text(e.comm_seconds)});
  std::ostringstream title;
  title << "`" << spec.name << "` (" << human_count(static_cast<double>(counts.total)) << " params), "
        << describe(l, e);
  if (!spec.shapeless()) title << ", seq " << e.seq_len << " x micro-batch " << l.micro_batch;
  std::ostringstream out;
  out << title.str() << "\n" << box_table({"per rank", "bytes"}, rows, "");
  out << "stage " << e.worst_stage << " of " << l.pp << " holds " << human_count(static_cast<double>(e.stage_params))
      << " params (" << human_count(static_cast<double>(e.trainable_params)) << " trainable)";
  if (spec.shapeless()) out << "; activations need the model's shapes (use a preset or config.json)";
  out << "\n";
  return out.str();
}

nlohmann::json layout_json(const Layout& l) {
  return {{"world_size", l.world_size},
          {"gpus_per_node", l.gpus_per_node},
          {"tp", l.tp},
          {"pp", l.pp},
          {"sharding", sharding_name(l.sharding, l.fsdp_names)},
          {"offload_optimizer", l.offload_optimizer},
          {"offload_params", l.offload_params},
          {"precision", precision_name(l.precision)},
          {"schedule", schedule_name(l.schedule)},
          {"virtual_stages", l.virtual_stages},
          {"microbatches", l.microbatches},
          {"seq_len", l.seq_len},
          {"micro_batch", l.micro_batch},
          {"recompute", recompute_name(l.recompute)},
          {"sequence_parallel", l.sequence_parallel},
          {"lora_rank", l.lora_rank},
          {"bucket_bytes", l.bucket_bytes}};
}

nlohmann::json rank_json(const RankEstimate& e) {
  nlohmann::json j = {{"dp", e.dp},
                      {"shard", e.shard},
                      {"worst_stage", e.worst_stage},
                      {"seq_len", e.seq_len},
                      {"stage_params", e.stage_params},
                      {"trainable_params", e.trainable_params},
                      {"frozen_params", e.frozen_params},
                      {"model_states", e.model_states()},
                      {"comm_seconds", e.comm_seconds}};
  nlohmann::json text = nlohmann::json::object();
  for (const auto& [label, key, value] : rank_figures(e)) {
    j[key] = value;
    text[label] = human_bytes(value);
  }
  text["comm time / step"] = seconds_text(e.comm_seconds);
  j["text"] = text;
  return j;
}

nlohmann::json counts_json(const ModelSpec& spec, const ParamCounts& c) {
  return {{"name", spec.name},
          {"arch", spec.family},
          {"total_params", c.total},
          {"base_model_params", c.base_model},
          {"embedding_params", c.embedding},
          {"per_layer_params", c.per_layer},
          {"num_layers", spec.num_layers},
          {"head_params", c.head},
          {"largest_module_params", c.largest_module},
          {"buffer_bytes", c.buffer_bytes}};
}

nlohmann::json scaletrain_json(const ModelSpec& spec, const ParamCounts& c, const Layout& l, const RankEstimate& e) {
  return {{"method", "scaletrain"},
          {"model", counts_json(spec, c)},
          {"layout", layout_json(l)},
          {"per_rank", rank_json(e)}};
}

// ---- planner ----------------------------------------------------------------

namespace {

std::vector<std::string> plan_cells(size_t index, const PlanRow& r) {
  const Layout& l = r.layout;
  const RankEstimate& e = r.estimate;
  std::string sharding = sharding_name(l.sharding, l.fsdp_names);
  if (l.offload_optimizer) sharding += l.offload_params ? "+offload(opt,param)" : "+offload(opt)";
  return {std::to_string(index + 1),   std::to_string(l.tp),           std::to_string(l.pp),
          std::to_string(e.dp),        sharding,                       recompute_name(l.recompute),
          l.sequence_parallel ? "yes" : "no", human_bytes(e.total),   human_bytes(e.model_states()),
          human_bytes(e.activations),  human_bytes(e.dp_comm_bytes + e.tp_comm_bytes + e.pp_comm_bytes + e.cp_comm_bytes),
          seconds_text(e.comm_seconds)};
}

const std::vector<std::string>& plan_headers() {
  static const std::vector<std::string> h = {"#",  "tp", "pp", "dp", "sharding", "recompute", "sp", "peak/rank",
                                             "model states", "activations", "comm/step", "comm time"};
  return h;
}

}  // namespace

std::string render_plan(const ModelSpec& spec, const PlanOptions& o, const std::vector<PlanRow>& rows) {
  std::ostringstream title;
  const int64_t gpn = o.base.gpus_per_node;
  char gb[32];
  std::snprintf(gb, sizeof gb, "%.4g GB", o.budget_bytes / 1e9);
  title << "Layouts of `" << spec.name << "` that fit " << gb << " (" << human_bytes(o.budget_bytes) << ") per rank on "
        << o.base.world_size << " ranks";
  if (gpn > 0) title << " (" << o.base.world_size / gpn << " nodes x " << gpn << ")";
  title << ", cheapest communication first";
  if (rows.empty())
    return title.str() + ":\n  none fits; try more ranks, --lora-rank, a shorter --seq-len, or offload\n";
  std::vector<std::vector<std::string>> cells;
  for (size_t i = 0; i < rows.size(); ++i) cells.push_back(plan_cells(i, rows[i]));
  std::ostringstream out;
  out << title.str() << "\n" << box_table(plan_headers(), cells, "");
  out << precision_name(o.base.precision) << ", seq " << (rows[0].estimate.seq_len) << " x micro-batch "
      << o.base.micro_batch << ", " << o.base.microbatches << " micro-batch(es)/step, "
      << schedule_name(o.base.schedule) << " when pp > 1\n";
  return out.str();
}

nlohmann::json plan_json(const ModelSpec& spec, const PlanOptions& o, const std::vector<PlanRow>& rows) {
  nlohmann::json out = {{"method", "plan"},
                        {"model", counts_json(spec, count_params(spec))},
                        {"budget_bytes", o.budget_bytes},
                        {"world_size", o.base.world_size},
                        {"gpus_per_node", o.base.gpus_per_node},
                        {"rows", nlohmann::json::array()}};
  for (size_t i = 0; i < rows.size(); ++i) {
    nlohmann::json text = nlohmann::json::object();
    const auto cells = plan_cells(i, rows[i]);
    for (size_t k = 0; k < cells.size(); ++k) text[plan_headers()[k]] = cells[k];
    out["rows"].push_back({{"layout", layout_json(rows[i].layout)},
                           {"per_rank", rank_json(rows[i].estimate)},
                           {"text", text}});
  }
  return out;
}

// The names of a layout's choices (memory_model.h).

const char* sharding_name(Sharding s, bool fsdp) {
  switch (s) {
    case Sharding::kNone:
      return fsdp ? "fsdp-no-shard" : "ddp";
    case Sharding::kZero1:
      return "zero-1";
    case Sharding::kZero2:
      return fsdp ? "fsdp-shard-grad-op" : "zero-2";
    case Sharding::kZero3:
      return fsdp ? "fsdp-full-shard" : "zero-3";
    case Sharding::kHybrid:
      return fsdp ? "fsdp-hybrid-shard" : "zero-3-hybrid";
  }
  return "?";
}

const char* precision_name(Precision p) {
  switch (p) {
    case Precision::kFp32:
      return "fp32";
    case Precision::kMixed16:
      return "mixed16";
    case Precision::kAutocast16:
      return "autocast16";
    case Precision::kPure16:
      return "pure16";
  }
  return "?";
}

const char* schedule_name(Schedule s) {
  switch (s) {
    case Schedule::kGPipe:
      return "gpipe";
    case Schedule::k1F1B:
      return "1f1b";
    case Schedule::kInterleaved:
      return "interleaved";
  }
  return "?";
}

const char* recompute_name(Recompute r) {
  switch (r) {
    case Recompute::kNone:
      return "none";
    case Recompute::kSelective:
      return "selective";
    case Recompute::kFull:
      return "full";
  }
  return "?";
}

std::string describe(const Layout& l, const RankEstimate& e) {
  std::ostringstream o;
  o << "tp=" << l.tp << " pp=" << l.pp << " dp=" << e.dp;
  if (l.ep > 1) o << " ep=" << l.ep;
  if (l.cp > 1) o << " cp=" << l.cp;
  o << " " << sharding_name(l.sharding, l.fsdp_names);
  if (l.sharding == Sharding::kHybrid) o << "(shard=" << e.shard << ")";
  if (l.offload_optimizer) o << " offload-opt";
  if (l.offload_params) o << " offload-param";
  o << " " << precision_name(l.precision);
  if (l.pp > 1) o << " " << schedule_name(l.schedule) << " m=" << l.microbatches;
  if (l.recompute != Recompute::kNone) o << " recompute=" << recompute_name(l.recompute);
  if (l.sequence_parallel) o << " sp";
  if (l.lora_rank > 0) o << (l.qlora ? " qlora=" : " lora=") << l.lora_rank;
  return o.str();
}

}  // namespace scaletrain::estimate

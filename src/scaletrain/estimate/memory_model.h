#pragma once
// scaletrain's own memory model: bytes per rank for a model under a layout
// (data / tensor / pipeline parallel degrees, ZeRO stage or FSDP strategy,
// precision policy, pipeline schedule, activation recompute, LoRA), plus the
// communication volume of one optimizer step. This is the function the trainer
// calls to log "estimated vs measured" (see estimate_rank).
//
// Model states follow the ZeRO paper (Rajbhandari et al. 2019): with mixed
// precision Adam every parameter costs 2 (16-bit weight) + 2 (16-bit grad) +
// K=12 (fp32 master, momentum, variance) bytes; stage 1 shards the K part over
// the N data-parallel ranks, stage 2 also the gradients, stage 3 everything:
//   baseline 16Psi, ZeRO-1 4Psi + 12Psi/N, ZeRO-2 2Psi + 14Psi/N, ZeRO-3 16Psi/N.
// Activations follow Korthikanti et al. 2022 ("Reducing Activation
// Recomputation in Large Transformer Models"); see activation_bytes_per_layer.
#include <cstdint>
#include <string>

#include "scaletrain/estimate/model_spec.h"

namespace scaletrain::estimate {

// How data-parallel ranks split model states. FSDP strategies map onto these:
// NO_SHARD = kNone, SHARD_GRAD_OP = kZero2, FULL_SHARD = kZero3,
// HYBRID_SHARD = kHybrid (ZeRO-3 inside a node, replicas across nodes).
enum class Sharding { kNone, kZero1, kZero2, kZero3, kHybrid };

// Where parameters, gradients and optimizer states live and in which width.
enum class Precision {
  kFp32,        // fp32 weights, grads, Adam states: 4 + 4 + 8 bytes/param
  kMixed16,     // 16-bit weights and grads + fp32 master and Adam states: 2 + 2 + 12 (ZeRO paper, K = 12)
  kAutocast16,  // fp32 weights, grads, states; 16-bit compute (torch autocast, FSDP MixedPrecision)
  kPure16,      // bf16 everywhere, Adam states in bf16: 2 + 2 + 4
};

// Pipeline schedules, by how many micro-batches a stage keeps activations for.
enum class Schedule {
  kGPipe,        // all forwards then all backwards: m micro-batches in flight
  k1F1B,         // one-forward-one-backward: stage i holds min(m, p - i)
  kInterleaved,  // 1F1B over v model chunks per stage: (1 + (p-1)/(p*v)) x the 1F1B volume
};

// Activation recomputation (Korthikanti et al. 2022, section 4).
enum class Recompute {
  kNone,       // store everything: s*b*h*(34 + 5*a*s/h) bytes per layer
  kSelective,  // recompute the attention core (softmax, dropout, QK^T, AV): s*b*h*34
  kFull,       // store only each layer's input: 2*s*b*h
};

// Which linear layers carry LoRA adapters.
enum class LoraTargets { kQv, kAttention, kAllLinear };

const char* sharding_name(Sharding s, bool fsdp_names = false);
const char* precision_name(Precision p);
const char* schedule_name(Schedule s);
const char* recompute_name(Recompute r);

// One training layout. World = dp * tp * pp; dp is derived.
struct Layout {
  int64_t world_size = 1;         // ranks in the job
  int64_t gpus_per_node = 0;      // ranks per machine; 0 = all on one machine
  int64_t tp = 1;                 // tensor-parallel degree (must divide heads and kv heads)
  int64_t pp = 1;                 // pipeline stages (must not exceed layers)
  Sharding sharding = Sharding::kNone;   // ZeRO stage / FSDP strategy over the dp ranks
  bool fsdp_names = false;        // label the sharding with FSDP's names in reports
  bool offload_optimizer = false;  // fp32 master + Adam states in host memory (ZeRO-Offload)
  bool offload_params = false;    // sharded 16-bit weights in host memory (ZeRO-3 / FSDP only)
  Precision precision = Precision::kMixed16;  // parameter/gradient/optimizer widths
  Schedule schedule = Schedule::k1F1B;        // pipeline schedule (ignored when pp == 1)
  int64_t virtual_stages = 2;     // model chunks per stage for kInterleaved
  int64_t microbatches = 1;       // micro-batches per optimizer step per dp rank (pipeline / accumulation)
  int64_t seq_len = 0;            // tokens per sample; 0 = model's max_positions (2048 if unknown)
  int64_t micro_batch = 1;        // samples per micro-batch
  Recompute recompute = Recompute::kNone;  // activation checkpointing policy
  bool dropout = true;                     // dropout active (p > 0): its masks and outputs are stored too
  bool flash_attention = false;  // tiled attention: no [s, s] scores kept, its output and row log-sum-exp instead
  bool fused_loss = false;       // head + cross-entropy fused: no [s, V] logits, the head's input and weight gradients instead
  bool fused_blocks = false;     // one-pass RMSNorm (keeps its input only) and SwiGLU (keeps gate and up only)
  bool sequence_parallel = false;  // Megatron SP: norms/dropout sharded over tp (needs tp > 1)
  int64_t lora_rank = 0;          // 0 = full fine-tuning; > 0 freezes the base weights
  LoraTargets lora_targets = LoraTargets::kQv;  // adapter placement when lora_rank > 0
  // Adapter parameters of one block on one tensor-parallel rank when the
  // caller counted them (the trainer, from its target layer names and their
  // splits); 0: from lora_rank and lora_targets. Set, lora_targets is read
  // only for whether the MLPs carry adapters (kAllLinear).
  int64_t lora_layer_params = 0;
  // QLoRA (needs lora_rank > 0): the blocks' frozen linear weights in NF4,
  // 4 bits each plus a double-quantized absmax per 64 (kNf4BytesPerParam),
  // each dequantized to the compute width for its own matmul only.
  bool qlora = false;
  // FP8 linears (precision.fp8): each linear of a block keeps FP8 codes (1
  // byte) of its input and weight for backward instead of its input in the
  // compute width (fp8_linear_activation_change), and its backward decodes
  // them to fp32 for the products.
  bool fp8_linears = false;
  // Adam's moments as FP8 (m) and fp16 (v) with per-tensor scales (MS-AMP O2,
  // Note [FP8 moments] in optim/adamw.h): 3 bytes per parameter, not 8.
  bool fp8_moments = false;
  // Sharded master weights in fp16 with fp32 gradient shards (MS-AMP O3,
  // Note [FP8 weight gathers] in parallel/fsdp): 2 bytes per trainable
  // parameter where the master took 4; gathered weights keep their width.
  bool fp16_masters = false;
  // Expert parallelism (parallel.ep): each rank holds 1/ep of every MoE
  // layer's experts, with their gradients and optimizer states.
  int64_t ep = 1;
  // Context parallelism (parallel.cp): each sequence split over cp ranks,
  // which hold seq_len / cp tokens' activations each and are data-parallel
  // peers for the parameters (states sharded over dp x cp).
  int64_t cp = 1;
  int64_t bucket_bytes = 25LL << 20;  // gradient bucket (DDP, ZeRO-1/2 reduce) in flight, x2 for overlap
  int64_t prefetch_units = 1;     // ZeRO-3/FSDP: layers gathered ahead of the one computing
  int64_t reduces_in_flight = 2;  // ZeRO/FSDP: gradient reduce-scatters in flight (max_inflight_reduces)
  bool gloo = false;              // collectives on Gloo (CPU): reduce-scatter into pooled whole-unit buffers
  double intra_node_gbps = 150;   // GB/s per rank inside a node (NVLink class), for comm time
  double inter_node_gbps = 25;    // GB/s per rank across nodes (200 Gb/s IB), for comm time
};

// Bytes per weight in NF4 with double quantization (precision/nf4.h): a
// nibble, one 8-bit absmax code per 64 weights, one fp32 scale per 64 * 256.
constexpr double kNf4BytesPerParam = 0.5 + 1.0 / 64 + 4.0 / (64 * 256);

// Bytes per rank on the worst pipeline stage, and the step's communication.
struct RankEstimate {
  // Degrees actually used.
  int64_t dp = 1;              // data-parallel replicas
  int64_t shard = 1;           // ranks a sharded state is split over (dp, or intra-node for hybrid)
  int64_t worst_stage = 0;     // pipeline stage that needs the most memory
  int64_t seq_len = 0;         // sequence length used
  // Parameter counts on that rank (after TP and PP split, before sharding).
  int64_t stage_params = 0;    // parameters of the stage's TP slice
  int64_t trainable_params = 0;  // of those, trained (LoRA adapters, or all)
  int64_t frozen_params = 0;     // of those, frozen base weights under LoRA
  // Device bytes.
  double params = 0;           // working weights held between steps (sharded under ZeRO-3)
  double gradients = 0;        // gradient storage (sharded under ZeRO-2/3)
  double master = 0;           // fp32 master copy of 16-bit weights
  double optimizer = 0;        // Adam momentum + variance
  double gathered = 0;         // ZeRO-3/FSDP: unsharded weights + grads of the root and the units in flight
  double comm_buffers = 0;     // reduce buffers (ZeRO/FSDP), DDP's one-time bucket rebuild
  double activations = 0;      // saved for backward, incl. embedding/logits extras on end stages
  double recomputed = 0;       // of those, re-materialized in backward (one layer under full recompute)
  double workspace = 0;        // what the worst moment adds: gradients in flight, or the step's temporaries
  double total = 0;            // sum of the above: the predicted peak (gathered, comm_buffers and
                               // workspace are their values at the worst moment, see estimate/peak.cpp)
  double host = 0;             // host bytes for offloaded states (per rank)
  // Communication of one optimizer step, bytes sent per rank (ring algorithms).
  double dp_comm_bytes = 0;    // gradient all-reduce / reduce-scatter / parameter all-gather
  double tp_comm_bytes = 0;    // Megatron all-reduces (or SP all-gather + reduce-scatter)
  double pp_comm_bytes = 0;    // activations and their gradients between stages
  double cp_comm_bytes = 0;    // keys and values (and their fp32 gradients) around the cp ring
  double comm_seconds = 0;     // the above over the link bandwidths of the groups they use
  double model_states() const { return params + gradients + master + optimizer; }
};

// Throws UsageError naming every degree when the layout cannot run the model:
// world not divisible by tp*pp, tp not dividing heads / kv heads, pp above the
// layer count, SP without TP, param offload without ZeRO-3, and so on.
void validate_layout(const ModelSpec& spec, const Layout& layout);

// The per-rank breakdown. Validates first. A raw parameter count (no shapes)
// gets model states only; tp/pp > 1 need shapes.
RankEstimate estimate_rank(const ModelSpec& spec, const Layout& layout);

// Activation bytes of one transformer layer for sequence s, micro-batch b,
// TP degree t (16-bit activations), after Korthikanti et al. 2022, whose
// block (LayerNorm, a 4h MLP of two linears) keeps
//   no TP:            s*b*h*(34 + 5*a*s/h)
//   TP:               s*b*h*(10 + 24/t + 5*a*s/(h*t))
//   TP + SP:          s*b*h*(34 + 5*a*s/h)/t
//   selective:        s*b*h*(10 + 24/t)      (TP + SP: s*b*h*34/t)
//   full recompute:   2*s*b*h                (TP + SP: 2*s*b*h/t)
// Without dropout (p = 0, scaletrain's default) the two 1-byte residual masks
// (sbh each) and the attention mask and dropout output (3as^2b) are not
// stored: 34 -> 32, 10 -> 8 and 5as/h -> 2as/h above (the attention-times-V
// product saves the softmax output itself). Other blocks change the two
// constants as Note [Activations of a block] (memory_model.cpp) derives: an
// MLP of width I keeps 4I/h (8I/h gated) in place of 16, an RMSNorm keeps two
// tensors where a LayerNorm keeps one.
// With flash attention (models/attention.h) the scores' 2as/h becomes the
// kernel's own copy of its output and its fp32 log-sum-exp per row: 2 + 4a/h.
// Fused (kernels/norm_activation.h): an RMSNorm keeps one tensor, not two,
// and a SwiGLU MLP 6I/h, not 8I/h.
double activation_bytes_per_layer(int64_t s, int64_t b, const ModelSpec& spec, int64_t t, bool sequence_parallel,
                                  Recompute recompute, bool dropout = true, bool flash = false,
                                  bool fused = false);

// What FP8 linears change in one layer's saved activations, in bytes (most
// often negative): each linear keeps its input as 1-byte codes (q, k and v
// each their own copy unless fused; gate and up theirs) where the block kept
// the input once in the compute `width`, plus 1 byte per weight of the
// block's linears (`layer_weights`, this rank's). Under full recompute a
// layer keeps only its input: nothing changes.
double fp8_linear_activation_change(int64_t s, int64_t b, const ModelSpec& spec, int64_t t, bool sequence_parallel,
                                    Recompute recompute, double width, double layer_weights);

// Micro-batches whose activations stage `stage` holds at its peak.
double inflight_microbatches(Schedule schedule, int64_t pp, int64_t stage, int64_t microbatches,
                             int64_t virtual_stages);

// Human-readable one-line description ("tp=2 pp=4 dp=8 zero-1 1f1b m=8 ...").
std::string describe(const Layout& layout, const RankEstimate& est);

}  // namespace scaletrain::estimate

#pragma once
// Sparse Mixture of Experts: Mixtral's block (a router and SwiGLU experts in
// place of the MLP), with a capacity limit, the load-balancing and z losses,
// and the hook an expert-parallel strategy fills in.
//
// Note [MoE routing]: for the N tokens x [N, C] of a layer,
//   - the router's logits are gate(x) [N, E] (no bias); probabilities are
//     their softmax in fp32; each token takes its k most probable experts,
//     and their probabilities renormalized to sum to 1 (Mixtral) are the
//     slot weights, cast to x's dtype;
//   - expert e is a SwiGLU MLP, w2(silu(w1 x) * w3 x), and a token's output
//     is the sum over its kept slots of weight * expert(x).
// Capacity and the load-balancing loss are defined per sequence: a group is
// the T tokens of one sequence. So any split of a batch into micro-batches,
// data-parallel ranks or expert-parallel ranks routes, drops and balances
// exactly as one process with the whole batch does (the invariant of
// DESIGN.md holds for MoE models too).
//   - Capacity (capacity_factor > 0; 0 is dropless): an expert takes at most
//     C = ceil(capacity_factor * T * k / E) slots of a sequence. Drop policy
//     "probs" keeps the slots with the highest router probability (ties: the
//     earlier token), "position" the slots of the earliest tokens. A dropped
//     slot contributes nothing (its weight is not given to the token's other
//     slots); a token whose slots are all dropped leaves the layer as it came
//     (the residual only).
//   - Load balancing: aux = E * sum_i f_i * P_i per sequence, f_i the share
//     of the sequence's T*k slots routed to expert i (before dropping), P_i
//     the mean probability of expert i over its T tokens; 1 when routing is
//     uniform. Hugging Face's Mixtral divides the slot counts by T instead of
//     T*k, so its value is k times this one for the same routing.
//   - z-loss: mean over tokens of logsumexp(logits)^2.
// A model's aux and z values are the means over its sequences and its MoE
// layers; the objective adds router_aux_loss_coef * aux + router_z_loss_coef * z.
//
// Note [Auxiliary losses]: the two losses never pass through the model's
// loss function. Each MoE layer attaches their gradient to its output: an
// identity whose backward also gives the layer's weighted aux and z terms
// the gradient `multiplier` (what the trainer multiplies the main loss by:
// the loss scale over the micro-batches). So pipeline stages, recomputed
// blocks and sharded units need nothing new, and the values are recorded on
// the side (MoeStats) for the metrics.
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "scaletrain/interfaces/experts.h"
#include "scaletrain/models/linear.h"

namespace scaletrain::models {

struct MoeOptions {
  int64_t num_experts = 8;            // E (num_local_experts)
  int64_t experts_per_token = 2;      // k (num_experts_per_tok)
  double capacity_factor = 0.0;       // 0: dropless
  std::string drop_policy = "probs";  // probs | position
  double aux_loss_coef = 0.0;         // router_aux_loss_coef
  double z_loss_coef = 0.0;           // router_z_loss_coef
  bool fused = true;                  // experts' SwiGLU in one pass each way (kernels/norm_activation.h)
};

// What the MoE layers of a model recorded since the last take(): the values
// of the forwards (detached), for the metrics.
struct MoeStats {
  double aux_sum = 0, z_sum = 0;  // sums of the layers' per-forward values
  int64_t forwards = 0;           // layer forwards recorded
  std::vector<int64_t> tokens_per_expert;  // slots routed to each expert (kept ones), summed over layers
  int64_t dropped = 0;                     // slots dropped by the capacity limit
};

// Shared by the MoE layers of one model.
struct MoeContext {
  double multiplier = 1.0;  // Note [Auxiliary losses]
  int64_t layers = 1;       // MoE layers of the model (the losses are their mean)
  int64_t experts = 0;      // experts per layer
  MoeStats stats;
  MoeStats take() { return std::exchange(stats, MoeStats{}); }
};
using MoeContextPtr = std::shared_ptr<MoeContext>;

// The routing of one layer's tokens (Note [MoE routing]).
struct Routing {
  torch::Tensor logits;   // [N, E], x's dtype (the router's output)
  torch::Tensor probs;    // [N, E] fp32
  torch::Tensor experts;  // [N, k] int64, each token's experts, most probable first
  torch::Tensor weights;  // [N, k] fp32, renormalized
  torch::Tensor kept;     // [N, k] bool: the slot survived the capacity limit
};
// Routes tokens given the router logits [N, E], for sequences of `seq_len`
// tokens (N a multiple of it).
Routing route(const torch::Tensor& logits, const MoeOptions& o, int64_t seq_len);
// The two auxiliary losses of a routing, as differentiable scalars (fp32).
torch::Tensor load_balancing_loss(const Routing& r, const MoeOptions& o, int64_t seq_len);
torch::Tensor router_z_loss(const Routing& r);

class MoeExpertImpl : public torch::nn::Module {
 public:
  MoeExpertImpl(int64_t width, int64_t inner, bool fused = true);
  torch::Tensor forward(const torch::Tensor& x);
  Linear w1{nullptr}, w2{nullptr}, w3{nullptr};

 private:
  bool fused_;
};
TORCH_MODULE(MoeExpert);

// Hugging Face's MixtralSparseMoeBlock: gate.weight, experts.J.w1/w2/w3.weight.
class SparseMoeBlockImpl : public torch::nn::Module {
 public:
  SparseMoeBlockImpl(int64_t width, int64_t inner, MoeOptions o);
  // x [B, T, C] -> [B, T, C]
  torch::Tensor forward(const torch::Tensor& x);
  // Expert parallelism: keeps only the hooks' experts (the others are
  // unregistered and freed) and moves tokens through the hooks from now on.
  void set_expert_parallel(interfaces::ExpertParallelHooksPtr hooks);
  int64_t local_experts() const { return static_cast<int64_t>(local_.size()); }
  torch::nn::Linear gate{nullptr};  // the router: never FP8, never adapted
  // Holds the experts under their global index ("experts.J"): only this
  // rank's under expert parallelism.
  std::shared_ptr<torch::nn::Module> experts;
  MoeContextPtr context;  // set by the model

 private:
  MoeOptions o_;
  std::vector<MoeExpert> local_;  // experts [first_, first_ + local_.size())
  int64_t first_ = 0;
  interfaces::ExpertParallelHooksPtr ep_;  // null: every expert is here
};
TORCH_MODULE(SparseMoeBlock);

}  // namespace scaletrain::models

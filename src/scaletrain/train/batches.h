#pragma once
// What the training loop reads each step: the token file opened as the data
// section asks, and how much each micro-batch's loss weighs in the step's.
//
// Note [Masked loss]
// The loss of a step is the mean over the target tokens of the global batch:
// the sum of the per-token losses / N, N = the targets in the step's G
// samples (data.loss_on picks which tokens are targets; pads never are, Note
// [Loss targets] in data/dataset.h). A model's loss() is the mean over its
// micro-batch's n_k targets, so micro-batch k is weighted by n_k * D / N
// (D = data-parallel ranks, whose gradients are averaged): the weighted sum
// over every rank and micro-batch is exactly the global mean, for any layout
// and any split into micro-batches, as the invariant demands. Every rank
// counts N and its n_k from the sampler's indices and the token file's mask
// (no communication). Without a mask, n_k = m T and N = G T, and the weight
// is 1 / accumulation exactly, as before masks existed.
//
// Note [Context-parallel batches]
// With parallel.cp = C > 1 the C ranks of one data-parallel coordinate load
// the same micro-batches and each keeps its tokens (Note [Load-balanced
// chunks] in parallel/context): inputs, targets, and a layout whose
// positions are the tokens' places in the whole sequence (inside their
// document when packed documents reset positions) and whose document ids
// travel with them. Rank c's loss is the mean over its n_kc targets, so it is
// weighted n_kc D C / N: the engines average over the D C ranks of dp x cp,
// and the sum over ranks and micro-batches is again the global mean.
#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "scaletrain/data/dataset.h"
#include "scaletrain/data/sampler.h"
#include "scaletrain/models/attention.h"
#include "scaletrain/train/plan/config.h"
#include "scaletrain/train/plan/plan.h"

namespace scaletrain::train {

// data.path, or data.mixture's datasets mixed (Note [Mixture]), as
// data.loss_on and data.packing ask (Note [Loss targets]). A loss on
// completions or assistant turns needs files of that record kind: UsageError
// naming the file and what it holds otherwise.
std::unique_ptr<data::SampleSource> open_dataset(const config::Config& config, const Plan& plan);

// The weight of each of this rank's `accum` micro-batches in step `step`
// (Note [Masked loss]). UsageError if no token of the global batch is a target.
std::vector<double> micro_weights(const data::SampleSource& dataset, const data::DistributedSampler& sampler,
                                  int64_t step, int dp_rank, int dp_size, int64_t micro_batch, int64_t accum,
                                  const std::string& loss_on, int64_t* global_targets = nullptr);

// Note [Context-parallel batches]: replaces a micro-batch [B, T] and its
// layout (null: none) by the part context-parallel rank `cp_rank` of `cp`
// keeps; the layout it leaves always has positions, and span T.
void keep_context_part(at::Tensor& inputs, at::Tensor& targets, std::shared_ptr<const models::SequenceLayout>& layout,
                       int cp_rank, int cp);

// The weight of a micro-batch part whose targets are `targets`, out of the
// step's `global_targets`, over dp x cp ranks (Note [Context-parallel batches]).
double context_weight(const at::Tensor& targets, int64_t global_targets, int dp, int cp);

// The text the end-of-run sample starts from: train.sample_prompt, or with
// train.sample_chat that prompt as a user message rendered with the chat
// template beside data.tokenizer (UsageError when there is none).
std::string sample_prompt_text(const config::Config& config);

}  // namespace scaletrain::train

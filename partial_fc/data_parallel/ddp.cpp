#include "partial_fc/data_parallel/ddp.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <map>
#include <unordered_set>

#include "base/error.h"

namespace faceshard {

namespace {
double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

void broadcast_module_state(torch::nn::Module& module, Distributed& dist, int root) {
  if (dist.world_size() == 1) return;
  std::vector<at::Tensor> all;
  for (auto& p : module.parameters()) all.push_back(p);
  for (auto& b : module.buffers()) all.push_back(b);
  // Group by (dtype, device) and send each group as one flat tensor.
  std::map<std::pair<int, std::string>, std::vector<at::Tensor>> groups;
  for (auto& t : all)
    if (t.defined() && t.numel() > 0)
      groups[{static_cast<int>(t.scalar_type()), t.device().str()}].push_back(t);
  torch::NoGradGuard ng;
  for (auto& g : groups) {
    std::vector<at::Tensor> flat;
    for (auto& t : g.second) flat.push_back(t.detach().reshape({-1}));
    at::Tensor buf = torch::cat(flat);
    dist.broadcast(buf, root);
    int64_t off = 0;
    for (auto& t : g.second) {
      t.detach().copy_(buf.narrow(0, off, t.numel()).view_as(t));
      off += t.numel();
    }
  }
}

DataParallel::DataParallel(std::shared_ptr<torch::nn::Module> module, Distributed& dist, DdpOptions opts)
    : module_(std::move(module)), dist_(dist), opts_(opts) {
  for (auto& np : module_->named_parameters()) {
    if (!np.value().requires_grad()) continue;
    params_.push_back(np.value());
    names_.push_back(np.key());
  }
  if (opts_.broadcast_on_construction) broadcast_module_state(*module_, dist_);

  if (opts_.flat) {
    use_flat_buckets();
  } else {
    make_buckets();
  }
  ready_.assign(params_.size(), 0);
  used_.assign(params_.size(), 0);
  frozen_.assign(params_.size(), 0);

  // A post-hook on each parameter's gradient accumulator fires once its .grad holds this
  // backward's full gradient.
  for (size_t i = 0; i < params_.size(); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(params_[i]);
    acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [this, i](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list& inputs) {
          on_grad_ready(static_cast<int>(i));
          return outputs;
        }));
    accumulators_.push_back(std::move(acc));
  }
}

void DataParallel::use_flat_buckets() {
  const FlatParameters& flat = *opts_.flat;
  bool same = flat.params().size() == params_.size();
  for (size_t i = 0; same && i < params_.size(); ++i)
    same = flat.params()[i].unsafeGetTensorImpl() == params_[i].unsafeGetTensorImpl();
  if (!same)
    throw runtime_error("DataParallel: the flat buffers hold other parameters than the module's trainable ones (",
                        flat.params().size(), " against ", params_.size(), ")");
  bucket_of_.assign(params_.size(), -1);
  slot_of_.assign(params_.size(), -1);
  for (const FlatParameters::Bucket& fb : flat.buckets()) {
    Bucket b;
    b.params = fb.params;
    b.offsets = fb.offsets;
    b.flat = flat.groups()[fb.group].grads.narrow(0, fb.offset, fb.numel);
    for (size_t s = 0; s < b.params.size(); ++s) {
      bucket_of_[b.params[s]] = static_cast<int>(buckets_.size());
      slot_of_[b.params[s]] = static_cast<int>(s);
    }
    buckets_.push_back(std::move(b));
  }
}

void DataParallel::make_buckets() {
  // Buckets in reverse registration order (roughly the order backward produces gradients),
  // one dtype/device per bucket, at most bucket_mb each.
  const int64_t cap = static_cast<int64_t>(opts_.bucket_mb * 1024 * 1024);
  bucket_of_.assign(params_.size(), -1);
  slot_of_.assign(params_.size(), -1);
  int64_t bytes = 0;
  for (int i = static_cast<int>(params_.size()) - 1; i >= 0; --i) {
    const at::Tensor& p = params_[i];
    const int64_t nb = p.numel() * p.element_size();
    auto part = [&](int k) { return opts_.partition.empty() ? 0 : opts_.partition.at(static_cast<size_t>(k)); };
    bool fresh = buckets_.empty() || bytes + nb > cap || part(buckets_.back().params[0]) != part(i) ||
                 params_[buckets_.back().params[0]].scalar_type() != p.scalar_type() ||
                 params_[buckets_.back().params[0]].device() != p.device();
    if (fresh) {
      buckets_.emplace_back();
      bytes = 0;
    }
    Bucket& b = buckets_.back();
    bucket_of_[i] = static_cast<int>(buckets_.size()) - 1;
    slot_of_[i] = static_cast<int>(b.params.size());
    b.offsets.push_back(b.params.empty() ? 0 : b.offsets.back() + params_[b.params.back()].numel());
    b.params.push_back(i);
    bytes += nb;
  }
  for (auto& b : buckets_) {
    const at::Tensor& last = params_[b.params.back()];
    b.flat = torch::zeros({b.offsets.back() + last.numel()}, last.options().requires_grad(false));
  }
}

DataParallel::~DataParallel() {
  // The hooks capture `this`: remove them with the accumulators they live on.
  for (auto& acc : accumulators_) acc->post_hooks().clear();
}

std::vector<std::vector<int>> DataParallel::bucket_assignment() const {
  std::vector<std::vector<int>> out;
  for (auto& b : buckets_) out.push_back(b.params);
  return out;
}

void DataParallel::prepare_for_backward(const std::vector<at::Tensor>& outputs) {
  prepared_ = true;
  if (dist_.world_size() == 1 || !sync_) return;
  std::fill(ready_.begin(), ready_.end(), 0);
  std::fill(used_.begin(), used_.end(), 0);
  for (auto& b : buckets_) {
    b.pending = static_cast<int>(b.params.size());
    b.work.reset();
  }
  next_bucket_ = 0;
  in_backward_ = false;
  stats_ = DdpStepStats();
  stats_.buckets = static_cast<int>(buckets_.size());
  t0_ = std::chrono::steady_clock::now();
  for (size_t i = 0; i < params_.size(); ++i) frozen_[i] = params_[i].requires_grad() ? 0 : 1;
  for (auto& b : buckets_) {
    b.frozen = true;
    for (int i : b.params) b.frozen = b.frozen && frozen_[i];
  }
  for (size_t i = 0; i < params_.size(); ++i)
    if (frozen_[i]) mark_ready(static_cast<int>(i), false);
  if (!opts_.find_unused_parameters) return;
  // Walk the graph from the outputs: accumulators it cannot reach belong to unused parameters.
  std::unordered_set<torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack;
  for (auto& o : outputs)
    if (o.defined() && o.grad_fn()) stack.push_back(o.grad_fn().get());
  while (!stack.empty()) {
    auto* n = stack.back();
    stack.pop_back();
    if (!seen.insert(n).second) continue;
    for (auto& e : n->next_edges())
      if (e.function) stack.push_back(e.function.get());
  }
  for (size_t i = 0; i < params_.size(); ++i)
    if (!seen.count(accumulators_[i].get())) mark_ready(static_cast<int>(i), false);
}

void DataParallel::on_grad_ready(int index) {
  if (dist_.world_size() == 1 || !sync_) return;
  if (!prepared_)
    throw runtime_error("DataParallel: backward ran without prepare_for_backward() after forward");
  if (!in_backward_) {
    in_backward_ = true;
    // Runs when the whole backward pass is done: wait for the buckets, write the averages.
    torch::autograd::Engine::get_default_engine().queue_callback([this] { finalize(); });
  }
  stats_.last_hook_ms = ms_since(t0_);
  mark_ready(index, true);
}

void DataParallel::mark_ready(int index, bool have_grad) {
  if (ready_[index]) return;
  ready_[index] = 1;
  used_[index] = have_grad ? 1 : 0;
  Bucket& b = buckets_[bucket_of_[index]];
  const at::Tensor& g = params_[index].grad();
  if (b.frozen) {
    // Nothing of this bucket is sent.
  } else if (opts_.flat) {
    // The gradient is the bucket's slot (laid out like the param) unless something
    // replaced it.
    at::Tensor slot = opts_.flat->view(index, opts_.flat->groups()[opts_.flat->group_of(index)].grads);
    if (!have_grad || !g.defined()) slot.zero_();
    else if (g.data_ptr() != slot.data_ptr()) slot.copy_(g);
  } else {
    at::Tensor slot = b.flat.narrow(0, b.offsets[slot_of_[index]], params_[index].numel());
    if (have_grad && g.defined()) slot.copy_(g.reshape({-1}));
    else slot.zero_();
  }
  if (--b.pending == 0) launch_ready_buckets();
}

void DataParallel::launch_ready_buckets() {
  // Strictly in bucket order on every rank: collectives must match one to one.
  while (next_bucket_ < static_cast<int>(buckets_.size()) && buckets_[next_bucket_].pending == 0) {
    Bucket& b = buckets_[next_bucket_];
    next_bucket_++;
    if (b.frozen) continue;
    b.work = dist_.all_reduce_async(b.flat);
    stats_.launch_ms.push_back(ms_since(t0_));
  }
}

void DataParallel::finalize() {
  in_backward_ = false;
  prepared_ = false;
  if (next_bucket_ < static_cast<int>(buckets_.size())) {
    std::string missing;
    int n = 0;
    for (size_t i = 0; i < params_.size(); ++i)
      if (!ready_[i] && n++ < 5) missing += (missing.empty() ? "'" : ", '") + names_[i] + "'";
    throw runtime_error("DataParallel: parameter ", missing, n > 5 ? " (and more)" : "",
                        " received no gradient in this step; if the model has branches that are not always used, "
                        "set dist.find_unused_parameters: true");
  }
  for (double t : stats_.launch_ms)
    if (t < stats_.last_hook_ms) stats_.launched_during_backward++;
  at::Tensor globally_used;
  if (opts_.find_unused_parameters) {
    globally_used = torch::tensor(std::vector<float>(used_.begin(), used_.end()));
    dist_.all_reduce(globally_used);
  }
  const double inv = 1.0 / dist_.world_size();
  torch::NoGradGuard ng;
  for (auto& b : buckets_) {
    if (b.frozen) continue;
    dist_.wait(b.work, "gradient all_reduce", b.flat.is_cuda());
    b.work.reset();
    b.flat.mul_(inv);
    for (size_t s = 0; s < b.params.size(); ++s) {
      const int i = b.params[s];
      at::Tensor& p = params_[i];
      if (frozen_[i]) continue;  // its .grad stays as it is (no step takes it)
      if (globally_used.defined() && globally_used[i].item<float>() == 0) continue;  // leave .grad as is
      if (opts_.flat) {
        // Averaged in place: the gradient is its slot (restored if something replaced it).
        at::Tensor slot = opts_.flat->view(i, opts_.flat->groups()[opts_.flat->group_of(i)].grads);
        if (!p.grad().defined() || p.grad().data_ptr() != slot.data_ptr()) p.mutable_grad() = slot;
        continue;
      }
      at::Tensor avg = b.flat.narrow(0, b.offsets[s], p.numel()).view(p.sizes());
      if (p.grad().defined()) p.mutable_grad().copy_(avg);
      else p.mutable_grad() = avg.clone();
    }
  }
}

}  // namespace faceshard

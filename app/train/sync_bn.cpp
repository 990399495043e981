#include "app/train/sync_bn.h"

#include "models/norm_layer.h"
#include "base/error.h"
#include "partial_fc/data_parallel/sync_batch_norm.h"

namespace faceshard {
namespace {

bool is_torch_batch_norm(const torch::nn::Module& m) {
  return dynamic_cast<const torch::nn::BatchNorm1dImpl*>(&m) || dynamic_cast<const torch::nn::BatchNorm2dImpl*>(&m);
}

int convert(torch::nn::Module& m, Distributed& dist, const std::string& path) {
  int n = 0;
  if (auto* seq = dynamic_cast<torch::nn::SequentialImpl*>(&m)) {
    // A Sequential forwards through its own list: rebuild the list with converted layers
    // and swap it into the same object (its parent holds that object).
    torch::nn::Sequential fresh;
    bool changed = false;
    for (size_t i = 0; i < seq->size(); ++i) {
      auto child = seq->ptr(i);
      if (is_torch_batch_norm(*child)) {
        const auto* b1 = dynamic_cast<const torch::nn::BatchNorm1dImpl*>(child.get());
        const auto* b2 = dynamic_cast<const torch::nn::BatchNorm2dImpl*>(child.get());
        const int64_t features = b1 ? b1->options.num_features() : b2->options.num_features();
        auto sbn = SyncBatchNorm(features, dist, b1 ? b1->options.eps() : b2->options.eps(),
                                 (b1 ? b1->options.momentum() : b2->options.momentum()).value_or(0.1));
        sbn->load_from(*child);
        sbn->train(child->is_training());
        fresh->push_back(std::to_string(i), sbn);
        changed = true;
        n++;
      } else {
        n += convert(*child, dist, path + "." + std::to_string(i));
        fresh->push_back(std::to_string(i), seq->begin()[static_cast<long>(i)]);
      }
    }
    if (changed) *seq = *fresh;
    return n;
  }
  for (auto& child : m.named_children()) {
    const std::string p = path.empty() ? child.key() : path + "." + child.key();
    if (auto* nl = dynamic_cast<NormLayerImpl*>(child.value().get())) {
      Distributed* d = &dist;
      nl->forward_override = [d](NormLayerImpl& self, const at::Tensor& x) {
        return sync_batch_norm(x, self.weight, self.bias, self.running_mean, self.running_var, self.num_batches_tracked,
                               self.is_training(), self.momentum, self.eps, *d);
      };
      n++;
    } else if (is_torch_batch_norm(*child.value())) {
      throw usage_error("model.sync_bn: layer '", p,
                        "' is a torch::nn::BatchNorm outside a Sequential and cannot be converted; build it as a "
                        "faceshard NormLayer");
    } else {
      n += convert(*child.value(), dist, p);
    }
  }
  return n;
}

}  // namespace

int convert_sync_batchnorm(torch::nn::Module& root, Distributed& dist) { return convert(root, dist, ""); }

}  // namespace faceshard

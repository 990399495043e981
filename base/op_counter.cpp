#include "base/op_counter.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>

#include <atomic>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "base/error.h"

namespace faceshard {
namespace {
std::atomic<int64_t> g_ops{0}, g_dispatched{0};
std::atomic<bool> g_active{false};
thread_local int t_counted_depth = 0;

struct Counted : at::ObserverContext {};

// Allocations and queries that launch nothing.
const std::unordered_set<std::string>& no_kernel() {
  static const std::unordered_set<std::string> names{
      "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::resize_", "aten::set_", "aten::lift_fresh",
      "aten::size", "aten::stride", "aten::numel", "aten::dim", "aten::is_same_size", "aten::_unsafe_view",
      "aten::is_nonzero", "aten::result_type", "aten::_has_compatible_shallow_copy_type"};
  return names;
}

bool view_of_schema(const std::string& name) {
  const auto pos = name.find('.');
  const c10::OperatorName op(pos == std::string::npos ? name : name.substr(0, pos),
                             pos == std::string::npos ? "" : name.substr(pos + 1));
  const auto handle = c10::Dispatcher::singleton().findOp(op);
  if (!handle || !handle->hasSchema()) return false;
  const auto& returns = handle->schema().returns();
  if (returns.size() != 1) return false;
  const c10::AliasInfo* alias = returns[0].alias_info();
  return alias != nullptr && !alias->isWrite();
}

std::mutex g_cache_mutex;
std::unordered_map<std::string, bool> g_cache;

bool counts(const at::RecordFunction& fn) {
  if (fn.scope() == at::RecordScope::USER_SCOPE) return true;
  const std::optional<c10::OperatorName> op = fn.operator_name();
  if (!op) return op_counts_as_launch(fn.name());
  return op_counts_as_launch(op->overload_name.empty() ? op->name : op->name + "." + op->overload_name);
}
}  // namespace

bool op_counts_as_launch(const std::string& name) {
  std::lock_guard<std::mutex> lock(g_cache_mutex);
  auto it = g_cache.find(name);
  if (it != g_cache.end()) return it->second;
  const bool launch = no_kernel().count(name.substr(0, name.find('.'))) == 0 && !view_of_schema(name);
  g_cache.emplace(name, launch);
  return launch;
}

OpCounter::OpCounter() {
  if (g_active.exchange(true)) throw runtime_error("OpCounter: another counter is active");
  g_ops = 0;
  g_dispatched = 0;
  was_enabled_ = at::isRecordFunctionEnabled();
  at::enableRecordFunction(true);
  handle_ = at::addGlobalCallback(
      at::RecordFunctionCallback(
          [](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
            g_dispatched.fetch_add(1, std::memory_order_relaxed);
            if (!counts(fn)) return nullptr;
            if (t_counted_depth++ == 0) g_ops.fetch_add(1, std::memory_order_relaxed);
            return std::make_unique<Counted>();
          },
          [](const at::RecordFunction&, at::ObserverContext* ctx) {
            if (ctx != nullptr) --t_counted_depth;
          })
          .needsInputs(false)
          .needsOutputs(false)
          .scopes({at::RecordScope::FUNCTION, at::RecordScope::USER_SCOPE}));
}

OpCounter::~OpCounter() {
  at::removeCallback(handle_);
  at::enableRecordFunction(was_enabled_);
  g_active = false;
}

int64_t OpCounter::count() const { return g_ops.load(); }
int64_t OpCounter::dispatched() const { return g_dispatched.load(); }

}  // namespace faceshard

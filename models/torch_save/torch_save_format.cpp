#include "models/torch_save/torch_save_format.h"

#include <cstring>
#include <fstream>
#include <map>
#include <unordered_map>

#include "models/torch_save/pickle_graph.h"
#include "base/error.h"

namespace faceshard {

namespace {

using Kind = PickleGraph::Kind;
using Node = PickleGraph::Node;

constexpr size_t kMaxDims = 64;

bool storage_type_of(const std::string& global, StorageType* t) {
  static const std::map<std::string, StorageType> types = {
      {"torch.FloatStorage", StorageType::Float}, {"torch.DoubleStorage", StorageType::Double},
      {"torch.HalfStorage", StorageType::Half},   {"torch.BFloat16Storage", StorageType::BFloat16},
      {"torch.LongStorage", StorageType::Long},   {"torch.IntStorage", StorageType::Int},
      {"torch.ShortStorage", StorageType::Short}, {"torch.CharStorage", StorageType::Char},
      {"torch.ByteStorage", StorageType::Byte},   {"torch.BoolStorage", StorageType::Bool}};
  auto it = types.find(global);
  if (it == types.end()) return false;
  *t = it->second;
  return true;
}

// Reads the object graph of a state_dict pickle. Nothing here recurses: a tensor is found
// by unwrapping at most a few Parameter calls, and every container is looked at one level
// deep.
class StateDictBuilder {
 public:
  StateDictBuilder(const PickleGraph& g, const std::string& path, uint64_t file_size)
      : g_(g), path_(path), file_size_(file_size) {}

  SavedStateDict build() {
    const Node& root = g_.at(g_.root());
    if (root.kind != Kind::Dict)
      throw runtime_error(path_, ": expected a state_dict (a dict of name -> tensor), got a ", describe(root));
    SavedStateDict out;
    std::unordered_map<std::string, size_t> position;
    for (size_t k = 0; k + 1 < root.items.size(); k += 2) {
      const Node& key = g_.at(root.items[k]);
      if (key.kind != Kind::String)
        throw runtime_error(path_, ": state_dict key is a ", describe(key), ", expected a string");
      SavedTensor t = tensor(root.items[k + 1], key.s);
      t.name = key.s;
      // A repeated key: as in a Python dict, the first place and the last value.
      auto [it, fresh] = position.emplace(key.s, out.tensors.size());
      if (fresh) out.tensors.push_back(std::move(t));
      else out.tensors[it->second] = std::move(t);
    }
    // Only the storages the tensors use (a replaced value may have left one unused).
    std::vector<size_t> remap(storages_.size(), SIZE_MAX);
    for (SavedTensor& t : out.tensors) {
      if (remap[t.storage] == SIZE_MAX) {
        remap[t.storage] = out.storages.size();
        out.storages.push_back(storages_[t.storage]);
      }
      t.storage = remap[t.storage];
    }
    return out;
  }

 private:
  std::string describe(const Node& n) const {
    std::string d = pickle_kind_name(n.kind);
    if (n.kind == Kind::Call && g_.at(n.items[0]).kind == Kind::Global)
      d += " of " + detail::printable(g_.at(n.items[0]).s);
    if (n.kind == Kind::Object && !n.s.empty()) d += " (" + detail::printable(n.s) + ")";
    return d;
  }
  const std::string& callee(const Node& call) const {
    static const std::string none;
    const Node& fn = g_.at(call.items[0]);
    return fn.kind == Kind::Global ? fn.s : none;
  }

  [[noreturn]] void bad_entry(const std::string& key, const std::string& what) const {
    throw runtime_error(path_, ": state_dict entry '", detail::printable(key), "': ", what);
  }

  SavedTensor tensor(uint32_t id, const std::string& key) {
    for (int unwrap = 0; unwrap < 4; ++unwrap) {
      const Node& v = g_.at(id);
      const std::string& fn = v.kind == Kind::Call ? callee(v) : std::string();
      const Node* args = v.kind == Kind::Call ? &g_.at(v.items[1]) : nullptr;
      if (fn == "torch._utils._rebuild_parameter" || fn == "torch._utils._rebuild_parameter_with_state") {
        if (args->kind != Kind::Tuple || args->items.empty()) bad_entry(key, fn + ": unexpected arguments");
        id = args->items[0];
        continue;
      }
      if (fn == "torch._utils._rebuild_tensor_v2" || fn == "torch._utils._rebuild_tensor") return rebuild(*args, key, fn);
      throw runtime_error(path_, ": state_dict entry '", detail::printable(key), "' is a ", describe(v),
                          ", expected a tensor (is this a full training checkpoint rather than a backbone "
                          "state_dict?)");
    }
    bad_entry(key, "Parameter nested in Parameter");
  }

  std::vector<int64_t> ints(uint32_t id, const std::string& key, const char* what) const {
    const Node& t = g_.at(id);
    if (t.kind != Kind::Tuple && t.kind != Kind::List) bad_entry(key, std::string("expected a tuple of ints as ") + what);
    if (t.items.size() > kMaxDims) bad_entry(key, "more than " + std::to_string(kMaxDims) + " dimensions");
    std::vector<int64_t> out;
    out.reserve(t.items.size());
    for (uint32_t i : t.items) {
      const Node& v = g_.at(i);
      if (v.kind != Kind::Int) bad_entry(key, std::string("expected a tuple of ints as ") + what);
      out.push_back(v.i);
    }
    return out;
  }

  SavedTensor rebuild(const Node& args, const std::string& key, const std::string& fn) {
    if (args.kind != Kind::Tuple || args.items.size() < 4 || g_.at(args.items[0]).kind != Kind::Persistent ||
        g_.at(args.items[1]).kind != Kind::Int)
      bad_entry(key, fn + ": unexpected arguments (expected storage, offset, sizes, strides)");
    SavedTensor t;
    t.storage = storage(g_.at(args.items[0]), key);
    t.offset = g_.at(args.items[1]).i;
    t.sizes = ints(args.items[2], key, "sizes");
    t.strides = ints(args.items[3], key, "strides");
    if (t.sizes.size() != t.strides.size()) bad_entry(key, "tensor sizes and strides differ in length");
    if (t.offset < 0) bad_entry(key, "negative storage offset");
    const SavedStorage& s = storages_[t.storage];
    // Element count and the last element's index, with every product checked for overflow.
    uint64_t numel = 1, last = uint64_t(t.offset);
    bool zero_stride = false;
    for (size_t d = 0; d < t.sizes.size(); ++d) {
      if (t.sizes[d] < 0 || t.strides[d] < 0) bad_entry(key, "negative tensor size or stride");
      if (__builtin_mul_overflow(numel, uint64_t(t.sizes[d]), &numel)) bad_entry(key, "tensor element count overflows");
    }
    if (numel > 0) {
      for (size_t d = 0; d < t.sizes.size(); ++d) {
        uint64_t span = 0;
        zero_stride = zero_stride || (t.strides[d] == 0 && t.sizes[d] > 1);
        if (__builtin_mul_overflow(uint64_t(t.sizes[d] - 1), uint64_t(t.strides[d]), &span) ||
            __builtin_add_overflow(last, span, &last))
          bad_entry(key, "tensor view overflows");
      }
      if (last >= s.numel)
        bad_entry(key, "tensor view (offset " + std::to_string(t.offset) + ", last element " + std::to_string(last) +
                           ") exceeds its storage of " + std::to_string(s.numel) + " elements");
    }
    // Each element of a view with no zero stride is a distinct storage element; with zero
    // strides (an expanded tensor) the view may repeat elements, but materialised it must
    // still fit in the file's size.
    uint64_t bytes = 0;
    if (numel > s.numel &&
        (!zero_stride || __builtin_mul_overflow(numel, uint64_t(storage_element_size(s.type)), &bytes) ||
         bytes > file_size_))
      bad_entry(key, "tensor of " + std::to_string(numel) + " elements is larger than its storage of " +
                         std::to_string(s.numel) + " elements");
    t.numel = numel;
    return t;
  }

  size_t storage(const Node& persistent, const std::string& key) {
    const Node& pid = g_.at(persistent.items[0]);
    auto item = [&](size_t i) -> const Node& { return g_.at(pid.items[i]); };
    if (pid.kind != Kind::Tuple || pid.items.size() < 5 || item(0).kind != Kind::String || item(0).s != "storage" ||
        item(1).kind != Kind::Global || item(2).kind != Kind::String || item(4).kind != Kind::Int)
      bad_entry(key, "unexpected persistent id (expected ('storage', type, key, location, numel))");
    StorageType type;
    if (!storage_type_of(item(1).s, &type)) bad_entry(key, "unsupported storage type " + detail::printable(item(1).s));
    const int64_t numel = item(4).i;
    uint64_t bytes = 0;
    if (numel < 0) bad_entry(key, "negative storage size");
    if (__builtin_mul_overflow(uint64_t(numel), uint64_t(storage_element_size(type)), &bytes) || bytes > file_size_)
      bad_entry(key, "storage of " + std::to_string(numel) + " elements is larger than the file");
    const std::string& skey = item(2).s;
    auto [it, fresh] = storage_index_.emplace(skey, storages_.size());
    if (fresh) {
      storages_.push_back({skey, type, uint64_t(numel)});
    } else {
      const SavedStorage& s = storages_[it->second];
      if (s.type != type || s.numel != uint64_t(numel))
        bad_entry(key, "storage '" + detail::printable(skey) + "' is declared with two different types or sizes");
    }
    return it->second;
  }

  const PickleGraph& g_;
  const std::string& path_;
  uint64_t file_size_;
  std::vector<SavedStorage> storages_;
  std::unordered_map<std::string, size_t> storage_index_;
};

}  // namespace

size_t storage_element_size(StorageType t) {
  switch (t) {
    case StorageType::Float: return 4;
    case StorageType::Double: return 8;
    case StorageType::Half: return 2;
    case StorageType::BFloat16: return 2;
    case StorageType::Long: return 8;
    case StorageType::Int: return 4;
    case StorageType::Short: return 2;
    case StorageType::Char: return 1;
    case StorageType::Byte: return 1;
    case StorageType::Bool: return 1;
  }
  return 1;
}

SavedStateDict parse_state_dict_pickle(const uint8_t* data, size_t size, const std::string& path, uint64_t file_size) {
  const PickleGraph g = parse_pickle(data, size, path + ": corrupt or unsupported torch.save file: data.pkl");
  return StateDictBuilder(g, path, file_size).build();
}

void TorchSaveFile::read_storage(size_t i, void* dst) const { zip.read(zip.entries()[storage_entries[i]], dst); }

ZipEntryStream TorchSaveFile::open_storage(size_t i, uint64_t begin, uint64_t end) const {
  const SavedStorage& s = dict.storages.at(i);
  const uint64_t bytes = s.numel * storage_element_size(s.type);  // equals its entry's size (checked at open)
  if (begin > end || end > bytes)
    throw runtime_error(path, ": byte range [", begin, ", ", end, ") lies outside storage '", detail::printable(s.key),
                        "' of ", bytes, " bytes");
  return ZipEntryStream(zip, zip.entries()[storage_entries[i]], begin, end);
}

bool is_contiguous(const SavedTensor& t) {
  int64_t expected = 1;
  for (size_t d = t.sizes.size(); d-- > 0;) {
    if (t.sizes[d] == 1) continue;
    if (t.strides[d] != expected) return false;
    expected *= t.sizes[d];
  }
  return true;
}

TorchSaveFile open_torch_save(ZipArchive zip, const std::string& path) {
  TorchSaveFile f{std::move(zip), {}, {}, path};
  const auto& entries = f.zip.entries();
  // As PyTorchStreamReader: the records live under the first entry's top-level folder.
  if (entries.empty()) throw runtime_error(path, ": cannot read torch.save file: the zip archive is empty");
  const std::string& first = entries.front().name;
  const size_t slash = first.find('/');
  if (slash == std::string::npos)
    throw runtime_error(path, ": cannot read torch.save file: entry '", detail::printable(first),
                        "' is not inside the archive's folder");
  const std::string prefix = first.substr(0, slash + 1);
  if (const ZipArchive::Entry* order = f.zip.find(prefix + "byteorder")) {
    if (order->size > 16) throw runtime_error(path, ": corrupt torch.save file: byteorder record of ", order->size, " bytes");
    const std::vector<uint8_t> b = f.zip.read(*order);
    const std::string text(b.begin(), b.end());
    if (text != "little")
      throw runtime_error(path, ": tensors are stored '", detail::printable(text), "'-endian; expected little-endian");
  }
  const ZipArchive::Entry* pkl = f.zip.find(prefix + "data.pkl");
  if (!pkl) throw runtime_error(path, ": corrupt torch.save file: no data.pkl record");
  {
    const std::vector<uint8_t> bytes = f.zip.read(*pkl);
    f.dict = parse_state_dict_pickle(bytes.data(), bytes.size(), path, f.zip.file_size());
  }
  for (const SavedStorage& s : f.dict.storages) {
    const std::string record = "data/" + s.key;
    const ZipArchive::Entry* e = f.zip.find(prefix + record);
    if (!e)
      throw runtime_error(path, ": corrupt torch.save file: storage record '", detail::printable(record), "' is missing");
    f.zip.check_stored(*e);
    const uint64_t want = s.numel * storage_element_size(s.type);  // no overflow: checked against the file size
    if (e->size != want)
      throw runtime_error(path, ": corrupt torch.save file: storage record '", detail::printable(record), "' has ",
                          e->size, " bytes, expected ", want);
    f.storage_entries.push_back(size_t(e - entries.data()));
  }
  return f;
}

TorchSaveFile open_torch_save(const std::string& path) {
  {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw runtime_error(path, ": cannot open state_dict file");
    char magic[4] = {0, 0, 0, 0};
    in.read(magic, 4);
    if (in.gcount() < 4 || std::memcmp(magic, "PK\x03\x04", 4) != 0)
      throw runtime_error(path, ": not a zip-format torch.save file (legacy pre-1.6 format or not "
                                "a checkpoint); re-save it with torch.save from PyTorch >= 1.6");
  }
  return open_torch_save(ZipArchive::open_file(path, path + ": cannot read torch.save file"), path);
}

}  // namespace faceshard

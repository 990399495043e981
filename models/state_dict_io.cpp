#include "models/state_dict_io.h"

#include <caffe2/serialize/inline_container.h>

#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <optional>

#include "partial_fc/runtime/error.h"

namespace faceshard {
namespace {

// ---------------------------------------------------------------------------------------
// Reading: a pickle virtual machine for the objects torch.save emits for a state_dict.
// Anything it does not understand becomes an opaque Object, so unexpected extras (the
// OrderedDict's _metadata, for one) are tolerated; only the top-level name -> tensor map
// must make sense.

struct PyValue;
using PyRef = std::shared_ptr<PyValue>;

struct PyValue {
  enum class Kind { None, Bool, Int, Float, String, Bytes, Tuple, List, Dict, Global, Tensor, Object };
  Kind kind = Kind::None;
  int64_t i = 0;
  double f = 0;
  std::string s;  // String/Bytes contents; Global/Object: "module.name"
  std::vector<PyRef> items;                   // Tuple, List
  std::vector<std::pair<PyRef, PyRef>> dict;  // Dict, in insertion order
  torch::Tensor tensor;                       // Tensor; a typed storage is a flat Tensor
};

PyRef make(PyValue::Kind kind) {
  auto v = std::make_shared<PyValue>();
  v->kind = kind;
  return v;
}

const char* kind_name(PyValue::Kind k) {
  switch (k) {
    case PyValue::Kind::None: return "None";
    case PyValue::Kind::Bool: return "bool";
    case PyValue::Kind::Int: return "int";
    case PyValue::Kind::Float: return "float";
    case PyValue::Kind::String: return "str";
    case PyValue::Kind::Bytes: return "bytes";
    case PyValue::Kind::Tuple: return "tuple";
    case PyValue::Kind::List: return "list";
    case PyValue::Kind::Dict: return "dict";
    case PyValue::Kind::Global: return "global";
    case PyValue::Kind::Tensor: return "tensor";
    case PyValue::Kind::Object: return "object";
  }
  return "?";
}

std::optional<torch::ScalarType> storage_dtype(const std::string& global_name) {
  static const std::map<std::string, torch::ScalarType> types = {
      {"torch.FloatStorage", torch::kFloat},    {"torch.DoubleStorage", torch::kDouble},
      {"torch.HalfStorage", torch::kHalf},      {"torch.BFloat16Storage", torch::kBFloat16},
      {"torch.LongStorage", torch::kLong},      {"torch.IntStorage", torch::kInt},
      {"torch.ShortStorage", torch::kShort},    {"torch.CharStorage", torch::kChar},
      {"torch.ByteStorage", torch::kByte},      {"torch.BoolStorage", torch::kBool}};
  auto it = types.find(global_name);
  if (it == types.end()) return std::nullopt;
  return it->second;
}

class Unpickler {
 public:
  Unpickler(const std::string& path, const char* data, size_t size,
            caffe2::serialize::PyTorchStreamReader& archive)
      : path_(path), data_(data), size_(size), archive_(archive) {}

  PyRef run() {
    while (true) {
      const size_t at = pos_;
      const uint8_t op = u8();
      switch (op) {
        case 0x80: u8(); break;                     // PROTO
        case 0x95: bytes(8); break;                 // FRAME (length only)
        case '.':                                   // STOP
          if (stack_.size() != 1) fail(at, "stack not balanced at STOP");
          return pop(at);
        case '(': marks_.push_back(stack_.size()); break;  // MARK
        case 'N': push(make(PyValue::Kind::None)); break;
        case 0x88: case 0x89: {                     // NEWTRUE / NEWFALSE
          auto v = make(PyValue::Kind::Bool);
          v->i = op == 0x88;
          push(v);
          break;
        }
        case 'J': push_int(static_cast<int32_t>(le(4))); break;  // BININT
        case 'K': push_int(static_cast<int64_t>(le(1))); break;  // BININT1
        case 'M': push_int(static_cast<int64_t>(le(2))); break;  // BININT2
        case 0x8a: push_int(long_le(u8(), at)); break;           // LONG1
        case 0x8b: push_int(long_le(static_cast<size_t>(le(4)), at)); break;  // LONG4
        case 'G': {                                 // BINFLOAT, big-endian
          uint64_t bits = 0;
          for (int k = 0; k < 8; ++k) bits = (bits << 8) | u8();
          auto v = make(PyValue::Kind::Float);
          std::memcpy(&v->f, &bits, 8);
          push(v);
          break;
        }
        case 'X': push_str(PyValue::Kind::String, le(4)); break;     // BINUNICODE
        case 0x8c: push_str(PyValue::Kind::String, u8()); break;     // SHORT_BINUNICODE
        case 0x8d: push_str(PyValue::Kind::String, le(8)); break;    // BINUNICODE8
        case 'T': push_str(PyValue::Kind::String, le(4)); break;     // BINSTRING
        case 'U': push_str(PyValue::Kind::String, u8()); break;      // SHORT_BINSTRING
        case 'B': push_str(PyValue::Kind::Bytes, le(4)); break;      // BINBYTES
        case 'C': push_str(PyValue::Kind::Bytes, u8()); break;       // SHORT_BINBYTES
        case 0x8e: push_str(PyValue::Kind::Bytes, le(8)); break;     // BINBYTES8
        case ')': push(make(PyValue::Kind::Tuple)); break;           // EMPTY_TUPLE
        case 0x85: case 0x86: case 0x87: {                           // TUPLE1..3
          const size_t n = op - 0x84;
          if (stack_.size() < n) fail(at, "stack underflow");
          auto t = make(PyValue::Kind::Tuple);
          t->items.assign(stack_.end() - n, stack_.end());
          stack_.resize(stack_.size() - n);
          push(t);
          break;
        }
        case 't': {                                                  // TUPLE
          auto t = make(PyValue::Kind::Tuple);
          t->items = pop_to_mark(at);
          push(t);
          break;
        }
        case ']': push(make(PyValue::Kind::List)); break;            // EMPTY_LIST
        case 'l': {                                                  // LIST
          auto l = make(PyValue::Kind::List);
          l->items = pop_to_mark(at);
          push(l);
          break;
        }
        case 'a': {                                                  // APPEND
          auto v = pop(at);
          top(at, PyValue::Kind::List)->items.push_back(v);
          break;
        }
        case 'e': {                                                  // APPENDS
          auto vs = pop_to_mark(at);
          auto& l = top(at, PyValue::Kind::List)->items;
          l.insert(l.end(), vs.begin(), vs.end());
          break;
        }
        case '}': push(make(PyValue::Kind::Dict)); break;            // EMPTY_DICT
        case 'd': {                                                  // DICT
          auto d = make(PyValue::Kind::Dict);
          add_pairs(*d, pop_to_mark(at), at);
          push(d);
          break;
        }
        case 's': {                                                  // SETITEM
          auto v = pop(at);
          auto k = pop(at);
          add_pairs(*top(at, PyValue::Kind::Dict), {k, v}, at);
          break;
        }
        case 'u': {                                                  // SETITEMS
          auto kvs = pop_to_mark(at);
          add_pairs(*top(at, PyValue::Kind::Dict), kvs, at);
          break;
        }
        case 'c': {                                                  // GLOBAL
          std::string module = line(at);
          std::string name = line(at);
          push_global(module + "." + name);
          break;
        }
        case 0x93: {                                                 // STACK_GLOBAL
          auto name = pop(at);
          auto module = pop(at);
          if (name->kind != PyValue::Kind::String || module->kind != PyValue::Kind::String)
            fail(at, "STACK_GLOBAL expects two strings");
          push_global(module->s + "." + name->s);
          break;
        }
        case 'R': {                                                  // REDUCE
          auto args = pop(at);
          auto callable = pop(at);
          push(reduce(*callable, *args, at));
          break;
        }
        case 0x81: {                                                 // NEWOBJ
          pop(at);
          auto cls = pop(at);
          auto o = make(PyValue::Kind::Object);
          o->s = cls->s;
          push(o);
          break;
        }
        case 'b': pop(at); top(at); break;  // BUILD: object state (e.g. _metadata) ignored
        case 'Q': {                                                  // BINPERSID
          auto pid = pop(at);
          push(persistent_load(*pid, at));
          break;
        }
        case 'q': memo_[static_cast<uint32_t>(le(1))] = top(at); break;  // BINPUT
        case 'r': memo_[static_cast<uint32_t>(le(4))] = top(at); break;  // LONG_BINPUT
        case 0x94: memo_[static_cast<uint32_t>(memo_.size())] = top(at); break;  // MEMOIZE
        case 'h': push(memo_get(static_cast<uint32_t>(le(1)), at)); break;  // BINGET
        case 'j': push(memo_get(static_cast<uint32_t>(le(4)), at)); break;  // LONG_BINGET
        case '0': pop(at); break;                                       // POP
        case '2': push(top(at)); break;                                 // DUP
        default: {
          char hex[8];
          std::snprintf(hex, sizeof hex, "0x%02x", op);
          fail(at, std::string("unsupported pickle opcode ") + hex);
        }
      }
    }
  }

 private:
  [[noreturn]] void fail(size_t at, const std::string& what) const {
    throw runtime_error(path_, ": corrupt or unsupported torch.save file: data.pkl offset ",
                        at, ": ", what);
  }
  uint8_t u8() {
    if (pos_ >= size_) fail(pos_, "truncated");
    return static_cast<uint8_t>(data_[pos_++]);
  }
  const char* bytes(size_t n) {
    if (n > size_ - pos_) fail(pos_, "truncated");
    const char* p = data_ + pos_;
    pos_ += n;
    return p;
  }
  uint64_t le(size_t n) {
    const char* p = bytes(n);
    uint64_t v = 0;
    for (size_t k = 0; k < n; ++k) v |= static_cast<uint64_t>(static_cast<uint8_t>(p[k])) << (8 * k);
    return v;
  }
  int64_t long_le(size_t n, size_t at) {
    if (n > 8) fail(at, "integer wider than 64 bits");
    if (n == 0) return 0;
    uint64_t v = le(n);
    if (n < 8 && (v >> (8 * n - 1)) & 1) v |= ~uint64_t{0} << (8 * n);  // sign-extend
    return static_cast<int64_t>(v);
  }
  std::string line(size_t at) {
    std::string s;
    while (true) {
      char c = static_cast<char>(u8());
      if (c == '\n') return s;
      s.push_back(c);
      if (s.size() > 256) fail(at, "GLOBAL name too long");
    }
  }
  void push(PyRef v) { stack_.push_back(std::move(v)); }
  void push_int(int64_t i) {
    auto v = make(PyValue::Kind::Int);
    v->i = i;
    push(v);
  }
  void push_str(PyValue::Kind kind, uint64_t n) {
    if (n > size_) fail(pos_, "string length beyond the file");
    auto v = make(kind);
    v->s.assign(bytes(static_cast<size_t>(n)), static_cast<size_t>(n));
    push(v);
  }
  void push_global(const std::string& name) {
    auto g = make(PyValue::Kind::Global);
    g->s = name;
    push(g);
  }
  PyRef pop(size_t at) {
    if (stack_.empty() || (!marks_.empty() && stack_.size() <= marks_.back()))
      fail(at, "stack underflow");
    PyRef v = stack_.back();
    stack_.pop_back();
    return v;
  }
  PyRef top(size_t at) {
    if (stack_.empty()) fail(at, "stack underflow");
    return stack_.back();
  }
  PyRef top(size_t at, PyValue::Kind kind) {
    PyRef v = top(at);
    if (v->kind != kind)
      fail(at, std::string("expected a ") + kind_name(kind) + " on the stack, got " + kind_name(v->kind));
    return v;
  }
  std::vector<PyRef> pop_to_mark(size_t at) {
    if (marks_.empty()) fail(at, "no MARK");
    const size_t m = marks_.back();
    marks_.pop_back();
    if (m > stack_.size()) fail(at, "MARK beyond the stack");
    std::vector<PyRef> out(stack_.begin() + m, stack_.end());
    stack_.resize(m);
    return out;
  }
  PyRef memo_get(uint32_t key, size_t at) {
    auto it = memo_.find(key);
    if (it == memo_.end()) fail(at, "memo key " + std::to_string(key) + " not set");
    return it->second;
  }
  void add_pairs(PyValue& d, const std::vector<PyRef>& kvs, size_t at) {
    if (kvs.size() % 2) fail(at, "odd number of dict items");
    for (size_t k = 0; k < kvs.size(); k += 2) d.dict.emplace_back(kvs[k], kvs[k + 1]);
  }

  std::vector<int64_t> int_tuple(const PyValue& t, size_t at) {
    if (t.kind != PyValue::Kind::Tuple && t.kind != PyValue::Kind::List) fail(at, "expected a tuple of ints");
    std::vector<int64_t> out;
    for (const auto& v : t.items) {
      if (v->kind != PyValue::Kind::Int) fail(at, "expected a tuple of ints");
      out.push_back(v->i);
    }
    return out;
  }

  PyRef reduce(const PyValue& callable, const PyValue& args, size_t at) {
    const std::string& fn = callable.kind == PyValue::Kind::Global ? callable.s : std::string();
    if (fn == "collections.OrderedDict" || fn == "builtins.dict") {
      auto d = make(PyValue::Kind::Dict);
      // OrderedDict([(k, v), ...]) in hand-written pickles; torch.save uses SETITEMS.
      if (!args.items.empty() && args.items[0]->kind == PyValue::Kind::List)
        for (const auto& kv : args.items[0]->items)
          if (kv->kind == PyValue::Kind::Tuple && kv->items.size() == 2)
            d->dict.emplace_back(kv->items[0], kv->items[1]);
      return d;
    }
    if (fn == "torch._utils._rebuild_tensor_v2" || fn == "torch._utils._rebuild_tensor") {
      if (args.items.size() < 4 || args.items[0]->kind != PyValue::Kind::Tensor ||
          args.items[1]->kind != PyValue::Kind::Int)
        fail(at, fn + ": unexpected arguments");
      const torch::Tensor& storage = args.items[0]->tensor;
      const int64_t offset = args.items[1]->i;
      auto sizes = int_tuple(*args.items[2], at);
      auto strides = int_tuple(*args.items[3], at);
      if (sizes.size() != strides.size()) fail(at, "tensor sizes and strides differ in length");
      int64_t last = offset;
      bool empty = false;
      for (size_t d = 0; d < sizes.size(); ++d) {
        if (sizes[d] < 0 || strides[d] < 0) fail(at, "negative tensor size or stride");
        if (sizes[d] == 0) empty = true;
        else last += (sizes[d] - 1) * strides[d];
      }
      if (offset < 0 || (!empty && last >= storage.numel()))
        fail(at, "tensor view exceeds its storage of " + std::to_string(storage.numel()) + " elements");
      auto t = make(PyValue::Kind::Tensor);
      t->tensor = storage.as_strided(sizes, strides, offset);
      return t;
    }
    if (fn == "torch._utils._rebuild_parameter" || fn == "torch._utils._rebuild_parameter_with_state") {
      if (args.items.empty() || args.items[0]->kind != PyValue::Kind::Tensor)
        fail(at, fn + ": unexpected arguments");
      return args.items[0];
    }
    auto o = make(PyValue::Kind::Object);
    o->s = fn.empty() ? std::string("<call>") : fn;
    return o;
  }

  PyRef persistent_load(const PyValue& pid, size_t at) {
    if (pid.kind != PyValue::Kind::Tuple || pid.items.size() < 5 ||
        pid.items[0]->kind != PyValue::Kind::String || pid.items[0]->s != "storage" ||
        pid.items[1]->kind != PyValue::Kind::Global || pid.items[2]->kind != PyValue::Kind::String ||
        pid.items[4]->kind != PyValue::Kind::Int)
      fail(at, "unexpected persistent id (expected ('storage', type, key, location, numel))");
    const std::string& key = pid.items[2]->s;
    auto cached = storages_.find(key);
    if (cached != storages_.end()) return cached->second;
    auto dtype = storage_dtype(pid.items[1]->s);
    if (!dtype) fail(at, "unsupported storage type " + pid.items[1]->s);
    const int64_t numel = pid.items[4]->i;
    if (numel < 0) fail(at, "negative storage size");
    const std::string record = "data/" + key;
    if (!archive_.hasRecord(record))
      throw runtime_error(path_, ": corrupt torch.save file: storage record '", record, "' is missing");
    const size_t nbytes = static_cast<size_t>(numel) * c10::elementSize(*dtype);
    const size_t have = archive_.getRecordSize(record);
    if (have != nbytes)
      throw runtime_error(path_, ": corrupt torch.save file: storage record '", record, "' has ",
                          have, " bytes, expected ", nbytes);
    torch::Tensor t = torch::empty({numel}, torch::TensorOptions().dtype(*dtype));
    if (nbytes > 0) archive_.getRecord(record, t.data_ptr(), nbytes);
    auto v = make(PyValue::Kind::Tensor);
    v->tensor = t;
    storages_[key] = v;
    return v;
  }

  std::string path_;
  const char* data_;
  size_t size_;
  size_t pos_ = 0;
  caffe2::serialize::PyTorchStreamReader& archive_;
  std::vector<PyRef> stack_;
  std::vector<size_t> marks_;
  std::map<uint32_t, PyRef> memo_;
  std::map<std::string, PyRef> storages_;
};

// ---------------------------------------------------------------------------------------
// Writing: the same pickle torch.save produces for an OrderedDict of plain tensors
// (protocol 2, GLOBAL + REDUCE of torch._utils._rebuild_tensor_v2, storages as persistent
// ids), which torch.load's weights_only unpickler accepts.

class PickleWriter {
 public:
  void op(uint8_t c) { out_.push_back(static_cast<char>(c)); }
  void global(const std::string& module, const std::string& name) {
    op('c');
    out_ += module + "\n" + name + "\n";
  }
  void str(const std::string& s) {
    op('X');
    u32(static_cast<uint32_t>(s.size()));
    out_ += s;
  }
  void integer(int64_t v) {
    if (v >= INT32_MIN && v <= INT32_MAX) {
      op('J');
      u32(static_cast<uint32_t>(static_cast<int32_t>(v)));
    } else {
      op(0x8a);  // LONG1, 8 bytes two's complement little-endian
      op(8);
      for (int k = 0; k < 8; ++k) op(static_cast<uint8_t>(static_cast<uint64_t>(v) >> (8 * k)));
    }
  }
  void int_tuple(c10::IntArrayRef values) {
    op('(');
    for (int64_t v : values) integer(v);
    op('t');
  }
  void empty_ordered_dict() {
    global("collections", "OrderedDict");
    op(')');
    op('R');
  }
  const std::string& bytes() const { return out_; }

 private:
  void u32(uint32_t v) {
    for (int k = 0; k < 4; ++k) op(static_cast<uint8_t>(v >> (8 * k)));
  }
  std::string out_;
};

const char* storage_type_name(torch::ScalarType t) {
  switch (t) {
    case torch::kFloat: return "FloatStorage";
    case torch::kDouble: return "DoubleStorage";
    case torch::kHalf: return "HalfStorage";
    case torch::kBFloat16: return "BFloat16Storage";
    case torch::kLong: return "LongStorage";
    case torch::kInt: return "IntStorage";
    case torch::kShort: return "ShortStorage";
    case torch::kChar: return "CharStorage";
    case torch::kByte: return "ByteStorage";
    case torch::kBool: return "BoolStorage";
    default: return nullptr;
  }
}

}  // namespace

StateDict read_state_dict(const std::string& path) {
  {
    std::ifstream f(path, std::ios::binary);
    if (!f) throw runtime_error(path, ": cannot open state_dict file");
    char magic[4] = {0, 0, 0, 0};
    f.read(magic, 4);
    if (f.gcount() < 4 || std::memcmp(magic, "PK\x03\x04", 4) != 0)
      throw runtime_error(path, ": not a zip-format torch.save file (legacy pre-1.6 format or not "
                                "a checkpoint); re-save it with torch.save from PyTorch >= 1.6");
  }
  try {
    caffe2::serialize::PyTorchStreamReader archive(path);
    if (archive.hasRecord("byteorder")) {
      auto [ptr, n] = archive.getRecord("byteorder");
      std::string order(static_cast<const char*>(ptr.get()), n);
      if (order != "little")
        throw runtime_error(path, ": tensors are stored ", order, "-endian; expected little-endian");
    }
    if (!archive.hasRecord("data.pkl"))
      throw runtime_error(path, ": corrupt torch.save file: no data.pkl record");
    auto [pkl, pkl_size] = archive.getRecord("data.pkl");
    Unpickler unpickler(path, static_cast<const char*>(pkl.get()), pkl_size, archive);
    PyRef root = unpickler.run();
    if (root->kind != PyValue::Kind::Dict)
      throw runtime_error(path, ": expected a state_dict (a dict of name -> tensor), got a ",
                          kind_name(root->kind));
    StateDict out;
    out.reserve(root->dict.size());
    for (const auto& [k, v] : root->dict) {
      if (k->kind != PyValue::Kind::String)
        throw runtime_error(path, ": state_dict key is a ", kind_name(k->kind), ", expected a string");
      if (v->kind != PyValue::Kind::Tensor)
        throw runtime_error(path, ": state_dict entry '", k->s, "' is a ", kind_name(v->kind),
                            v->kind == PyValue::Kind::Object ? " (" + v->s + ")" : std::string(),
                            ", expected a tensor (is this a full training checkpoint rather "
                            "than a backbone state_dict?)");
      out.emplace_back(k->s, v->tensor);
    }
    return out;
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw runtime_error(path, ": cannot read torch.save file: ", one_line(e));
  }
}

void write_state_dict(const StateDict& weights, const std::string& path) {
  std::vector<torch::Tensor> storages;
  storages.reserve(weights.size());
  PickleWriter p;
  p.op(0x80);
  p.op(2);
  p.empty_ordered_dict();
  p.op('(');
  for (const auto& [name, value] : weights) {
    if (!value.defined()) throw usage_error(path, ": cannot save '", name, "': undefined tensor");
    const char* type = storage_type_name(value.scalar_type());
    if (!type)
      throw usage_error(path, ": cannot save '", name, "': unsupported dtype ", value.scalar_type());
    torch::Tensor t = value.detach().to(torch::kCPU).contiguous();
    const std::string key = std::to_string(storages.size());
    p.str(name);
    p.global("torch._utils", "_rebuild_tensor_v2");
    p.op('(');
    p.op('(');  // persistent id ('storage', torch.XStorage, key, 'cpu', numel)
    p.str("storage");
    p.global("torch", type);
    p.str(key);
    p.str("cpu");
    p.integer(t.numel());
    p.op('t');
    p.op('Q');
    p.integer(0);
    p.int_tuple(t.sizes());
    p.int_tuple(t.strides());
    p.op(0x89);  // requires_grad False: a state_dict holds detached tensors
    p.empty_ordered_dict();
    p.op('t');
    p.op('R');
    storages.push_back(t);
  }
  p.op('u');
  p.op('.');
  try {
    caffe2::serialize::PyTorchStreamWriter writer(path);
    writer.writeRecord("data.pkl", p.bytes().data(), p.bytes().size());
    writer.writeRecord("byteorder", "little", 6);
    for (size_t k = 0; k < storages.size(); ++k) {
      const auto& t = storages[k];
      writer.writeRecord("data/" + std::to_string(k), t.data_ptr(), t.numel() * t.element_size());
    }
    writer.writeEndOfFile();
  } catch (const std::exception& e) {
    throw runtime_error(path, ": cannot write state_dict file: ", one_line(e));
  }
}

}  // namespace faceshard

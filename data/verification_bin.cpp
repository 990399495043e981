#include "data/verification_bin.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <iterator>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "base/error.h"

namespace faceshard {

namespace {

// A valid .bin nests containers two deep at most: the (bins, issame) pair holds two lists
// of scalars (and a REDUCE argument tuple holds strings). Deeper values are rejected as
// they are built, so no value is ever deeper than this and freeing one (shared_ptr
// destructors recurse per level) cannot exhaust the C++ stack.
constexpr int kMaxDepth = 2;
// Bounds on what the parser keeps (each BINGET pushes another reference for two input
// bytes): far above a real set's needs (lfw: 12000 images, batched 1000 per APPENDS) while
// keeping a hostile file from growing memory without limit.
constexpr size_t kMaxStack = size_t(1) << 20;
constexpr size_t kMaxMemo = size_t(1) << 20;

struct Items;

// The few kinds of Python object a .bin can hold.
struct Value {
  enum Kind { Bytes, Text, Bool, Int, None, List, Tuple, Global } kind = None;
  std::shared_ptr<std::vector<uint8_t>> bytes;  // Bytes; Text keeps its UTF-8 here; Global its name
  std::shared_ptr<Items> items;                 // List, Tuple
  int64_t number = 0;                           // Bool, Int
};

// A container's elements plus what the depth rule needs: its nesting depth (1: only
// scalars) and whether it already sits inside another container. A contained list may
// still receive scalars but no containers, so the recorded depth of every container that
// holds it stays true; together with the depth limit this keeps values acyclic and shallow.
struct Items : std::vector<Value> {
  int depth = 1;
  bool contained = false;
};

const char* kind_name(Value::Kind k) {
  switch (k) {
    case Value::Bytes: return "bytes";
    case Value::Text: return "str";
    case Value::Bool: return "bool";
    case Value::Int: return "int";
    case Value::None: return "None";
    case Value::List: return "list";
    case Value::Tuple: return "tuple";
    case Value::Global: return "global";
  }
  return "?";
}

class PickleParser {
 public:
  PickleParser(const uint8_t* data, size_t size, const std::string& name) : p_(data), n_(size), name_(name) {}

  Value run() {
    while (true) {
      op_pos_ = pos_;
      const uint8_t op = take(1)[0];
      switch (op) {
        case 0x80: {  // PROTO
          const uint8_t proto = take(1)[0];
          if (proto > 5) fail(detail::concat("unsupported pickle protocol ", int(proto)));
          break;
        }
        case 0x95: {  // FRAME: a length hint only; the opcodes inside are read as usual
          const uint64_t len = u64(take(8));
          if (len > n_ - pos_) fail("frame runs past the end of the data");
          break;
        }
        case '(':  // MARK
          if (marks_.size() >= kMaxStack) fail(detail::concat("more than ", kMaxStack, " open MARKs"));
          marks_.push_back(stack_.size());
          break;
        case '.': return stop();                          // STOP
        case '0': pop(); break;                           // POP
        case '1': pop_mark(); break;                      // POP_MARK
        case ']': push(list({})); break;                  // EMPTY_LIST
        case 'l': push(list(pop_mark())); break;          // LIST
        case ')': push(tuple({})); break;                 // EMPTY_TUPLE
        case 't': push(tuple(pop_mark())); break;         // TUPLE
        case 0x85: push(tuple(pop_n(1))); break;          // TUPLE1
        case 0x86: push(tuple(pop_n(2))); break;          // TUPLE2
        case 0x87: push(tuple(pop_n(3))); break;          // TUPLE3
        case 'a': {                                       // APPEND
          Value v = pop();
          append(std::vector<Value>{std::move(v)});
          break;
        }
        case 'e': append(pop_mark()); break;  // APPENDS
        case 0x88: push(boolean(true)); break;   // NEWTRUE
        case 0x89: push(boolean(false)); break;  // NEWFALSE
        case 'N': push(Value{}); break;          // NONE
        case 'K': push(integer(take(1)[0])); break;  // BININT1
        case 'M': {                                  // BININT2
          const uint8_t* b = take(2);
          push(integer(int64_t(b[0]) | (int64_t(b[1]) << 8)));
          break;
        }
        case 'J': push(integer(int32_t(u32(take(4))))); break;  // BININT
        case 'I': {                                              // INT (protocol 0; "01"/"00" are bools)
          const std::string s = line();
          if (s == "01") push(boolean(true));
          else if (s == "00") push(boolean(false));
          else push(integer(parse_int(s)));
          break;
        }
        case 'U': push(bytes(take_len(take(1)[0]))); break;        // SHORT_BINSTRING (py2 str)
        case 'T': {                                                // BINSTRING (py2 str, signed length)
          const int32_t len = int32_t(u32(take(4)));
          if (len < 0) fail("negative string length");
          push(bytes(take_len(uint64_t(len))));
          break;
        }
        case 'C': push(bytes(take_len(take(1)[0]))); break;   // SHORT_BINBYTES
        case 'B': push(bytes(take_len(u32(take(4))))); break;  // BINBYTES
        case 0x8e: push(bytes(take_len(u64(take(8))))); break; // BINBYTES8
        case 0x96: push(bytes(take_len(u64(take(8))))); break; // BYTEARRAY8
        case 0x8c: push(text(take_len(take(1)[0]))); break;    // SHORT_BINUNICODE
        case 'X': push(text(take_len(u32(take(4))))); break;   // BINUNICODE
        case 0x8d: push(text(take_len(u64(take(8))))); break;  // BINUNICODE8
        case 'c': {                                            // GLOBAL "module\nname\n"
          std::string module = line();
          std::string nm = line();
          push(global(module + "." + nm));
          break;
        }
        case 0x93: {  // STACK_GLOBAL
          Value nm = pop(), module = pop();
          if (module.kind != Value::Text || nm.kind != Value::Text) fail("STACK_GLOBAL needs two strings");
          // Names are short; a cap keeps GETs of one long str from copying it per opcode.
          if (module.bytes->size() > 256 || nm.bytes->size() > 256) fail("STACK_GLOBAL name longer than 256 bytes");
          push(global(as_string(module) + "." + as_string(nm)));
          break;
        }
        case 'R': {  // REDUCE: only the constructors protocol 2 uses for bytes
          Value args = pop();
          Value fn = pop();
          push(reduce(fn, args));
          break;
        }
        case 'q': memo_put(take(1)[0]); break;   // BINPUT
        case 'r': memo_put(u32(take(4))); break; // LONG_BINPUT
        case 0x94: memo_put(memo_.size()); break; // MEMOIZE
        case 'p': memo_put(uint64_t(parse_int(line()))); break;  // PUT
        case 'h': memo_get(take(1)[0]); break;   // BINGET
        case 'j': memo_get(u32(take(4))); break; // LONG_BINGET
        case 'g': memo_get(uint64_t(parse_int(line()))); break;  // GET
        default: {
          char hex[8];
          std::snprintf(hex, sizeof hex, "0x%02x", op);
          fail(detail::concat("pickle opcode ", hex, " is not allowed in a verification .bin"));
        }
      }
    }
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw runtime_error(name_, ": not an insightface verification .bin: ", what, " (pickle byte offset ", op_pos_, ")");
  }

  const uint8_t* take(uint64_t len) {
    if (len > n_ - pos_) fail("truncated pickle data");
    const uint8_t* r = p_ + pos_;
    pos_ += size_t(len);
    return r;
  }
  std::shared_ptr<std::vector<uint8_t>> take_len(uint64_t len) {
    const uint8_t* b = take(len);  // checked against the remaining bytes before allocating
    return std::make_shared<std::vector<uint8_t>>(b, b + len);
  }
  static uint32_t u32(const uint8_t* b) {
    return uint32_t(b[0]) | (uint32_t(b[1]) << 8) | (uint32_t(b[2]) << 16) | (uint32_t(b[3]) << 24);
  }
  static uint64_t u64(const uint8_t* b) { return uint64_t(u32(b)) | (uint64_t(u32(b + 4)) << 32); }
  std::string line() {
    const size_t start = pos_;
    while (pos_ < n_ && p_[pos_] != '\n') {
      if (pos_ - start > 256) fail("text argument too long");
      ++pos_;
    }
    if (pos_ >= n_) fail("truncated pickle data");
    std::string s(reinterpret_cast<const char*>(p_ + start), pos_ - start);
    ++pos_;
    return s;
  }
  int64_t parse_int(std::string s) {
    if (!s.empty() && s.back() == 'L') s.pop_back();
    if (s.empty() || s.size() > 18) fail("bad integer argument");
    size_t i = (s[0] == '-') ? 1 : 0;
    if (i == s.size()) fail("bad integer argument");
    int64_t v = 0;
    for (; i < s.size(); ++i) {
      if (s[i] < '0' || s[i] > '9') fail("bad integer argument");
      v = v * 10 + (s[i] - '0');
    }
    return s[0] == '-' ? -v : v;
  }

  Value list(std::vector<Value> items) const {
    Value v;
    v.kind = Value::List;
    v.items = std::make_shared<Items>();
    for (auto& x : items) {
      if (x.kind == Value::Global) fail("a container element is a global");
      if (x.items) {
        x.items->contained = true;
        v.items->depth = std::max(v.items->depth, 1 + x.items->depth);
      }
    }
    if (v.items->depth > kMaxDepth) fail(too_deep());
    static_cast<std::vector<Value>&>(*v.items) = std::move(items);
    return v;
  }
  Value tuple(std::vector<Value> items) const {
    Value v = list(std::move(items));
    v.kind = Value::Tuple;
    return v;
  }
  static std::string too_deep() {
    return detail::concat("containers nested more than ", kMaxDepth,
                          " deep (a .bin is a pair of lists of images and labels)");
  }
  static Value boolean(bool b) {
    Value v;
    v.kind = Value::Bool;
    v.number = b;
    return v;
  }
  static Value integer(int64_t i) {
    Value v;
    v.kind = Value::Int;
    v.number = i;
    return v;
  }
  static Value bytes(std::shared_ptr<std::vector<uint8_t>> b) {
    Value v;
    v.kind = Value::Bytes;
    v.bytes = std::move(b);
    return v;
  }
  static Value text(std::shared_ptr<std::vector<uint8_t>> b) {
    Value v = bytes(std::move(b));
    v.kind = Value::Text;
    return v;
  }
  static Value global(const std::string& g) {
    Value v;
    v.kind = Value::Global;
    v.bytes = std::make_shared<std::vector<uint8_t>>(g.begin(), g.end());
    return v;
  }
  static std::string as_string(const Value& v) { return std::string(v.bytes->begin(), v.bytes->end()); }


 public:
  // A str that stands for bytes (py2 str loaded as latin-1, or protocol 2's
  // _codecs.encode(s, 'latin1')): every code point must fit in one byte. Converted once
  // per str object, however often the pickle refers to it.
  std::shared_ptr<std::vector<uint8_t>> latin1(const Value& v) {
    auto cached = latin1_.find(v.bytes.get());
    if (cached != latin1_.end()) return cached->second;
    auto out = latin1_uncached(*v.bytes);
    latin1_.emplace(v.bytes.get(), out);
    latin1_sources_.push_back(v.bytes);  // keeps the key's buffer alive, so the key stays unique
    return out;
  }

 private:
  std::shared_ptr<std::vector<uint8_t>> latin1_uncached(const std::vector<uint8_t>& u) {
    auto out = std::make_shared<std::vector<uint8_t>>();
    out->reserve(u.size());
    for (size_t i = 0; i < u.size();) {
      const uint8_t c = u[i];
      if (c < 0x80) {
        out->push_back(c);
        i += 1;
      } else if ((c & 0xe0) == 0xc0 && i + 1 < u.size() && (u[i + 1] & 0xc0) == 0x80) {
        const uint32_t cp = (uint32_t(c & 0x1f) << 6) | (u[i + 1] & 0x3f);
        if (cp < 0x80 || cp > 0xff) fail("str holds a character above U+00FF, so it is not latin-1 encoded bytes");
        out->push_back(uint8_t(cp));
        i += 2;
      } else {
        fail("str is not UTF-8 text of latin-1 characters");
      }
    }
    return out;
  }

 private:
  Value reduce(const Value& fn, const Value& args) {
    if (fn.kind != Value::Global) fail("REDUCE of a non-global");
    const std::string fn_name = as_string(fn);
    if (args.kind != Value::Tuple) fail("REDUCE arguments are not a tuple");
    const auto& a = *args.items;
    const bool is_encode = fn_name == "_codecs.encode";
    const bool is_bytes = fn_name == "__builtin__.bytes" || fn_name == "builtins.bytes" ||
                          fn_name == "__builtin__.bytearray" || fn_name == "builtins.bytearray";
    if (!is_encode && !is_bytes) fail(detail::concat("pickle calls ", detail::printable(fn_name), ", which a .bin never does"));
    if (is_bytes && a.empty()) return bytes(std::make_shared<std::vector<uint8_t>>());
    if (is_bytes && a.size() == 1 && a[0].kind == Value::Bytes) return a[0];
    if (a.size() == 2 && a[0].kind == Value::Text && a[1].kind == Value::Text) {
      const std::string enc = as_string(a[1]);
      if (enc == "latin1" || enc == "latin-1" || enc == "iso-8859-1") return bytes(latin1(a[0]));
    }
    fail(detail::concat("unsupported arguments to ", detail::printable(fn_name)));
  }

  void push(Value v) {
    if (stack_.size() >= kMaxStack) fail(detail::concat("pickle stack grows past ", kMaxStack, " items"));
    stack_.push_back(std::move(v));
  }
  Value pop() {
    const size_t floor = marks_.empty() ? 0 : marks_.back();
    if (stack_.size() <= floor) fail("stack underflow");
    Value v = std::move(stack_.back());
    stack_.pop_back();
    return v;
  }
  std::vector<Value> pop_n(size_t k) {
    const size_t floor = marks_.empty() ? 0 : marks_.back();
    if (stack_.size() < floor + k) fail("stack underflow");
    std::vector<Value> out(std::make_move_iterator(stack_.end() - k), std::make_move_iterator(stack_.end()));
    stack_.resize(stack_.size() - k);
    return out;
  }
  std::vector<Value> pop_mark() {
    if (marks_.empty()) fail("no MARK on the stack");
    const size_t m = marks_.back();
    marks_.pop_back();
    std::vector<Value> out(std::make_move_iterator(stack_.begin() + m), std::make_move_iterator(stack_.end()));
    stack_.resize(m);
    return out;
  }
  void append(std::vector<Value> items) {
    const size_t floor = marks_.empty() ? 0 : marks_.back();
    if (stack_.size() <= floor || stack_.back().kind != Value::List) fail("APPEND to something that is not a list");
    Items& target = *stack_.back().items;
    for (auto& v : items) {
      // [bins, issame] appends lists to a list. The depth rule (see Items) keeps the
      // shared_ptr graph acyclic and at most kMaxDepth deep, so it is freed without
      // deep recursion.
      if (v.kind == Value::Global) fail("a list element is a global");
      if (v.items) {
        if (v.items.get() == &target) fail("a list appended to itself");
        const int depth = std::max(target.depth, 1 + v.items->depth);
        if (depth > kMaxDepth) fail(too_deep());
        if (depth > target.depth && target.contained) {
          fail("a container appended to a list that is already inside another container");
        }
        target.depth = depth;
        v.items->contained = true;
      }
      target.push_back(std::move(v));
    }
  }
  void memo_put(uint64_t index) {
    if (stack_.empty()) fail("PUT with an empty stack");
    if (memo_.size() >= kMaxMemo && memo_.count(index) == 0) {
      fail(detail::concat("pickle memo grows past ", kMaxMemo, " entries"));
    }
    memo_[index] = stack_.back();
  }
  void memo_get(uint64_t index) {
    auto it = memo_.find(index);
    if (it == memo_.end()) fail(detail::concat("GET of memo entry ", index, " that was never stored"));
    push(it->second);
  }

  Value stop() {
    if (!marks_.empty() || stack_.size() != 1) fail("STOP with a malformed stack");
    return std::move(stack_.back());
  }

  const uint8_t* p_;
  size_t n_;
  size_t pos_ = 0;
  size_t op_pos_ = 0;
  std::string name_;
  std::vector<Value> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, Value> memo_;
  // str buffer -> its latin-1 bytes; the buffers are kept alive in latin1_sources_.
  std::unordered_map<const void*, std::shared_ptr<std::vector<uint8_t>>> latin1_;
  std::vector<std::shared_ptr<std::vector<uint8_t>>> latin1_sources_;

};

}  // namespace

VerificationSet parse_verification_bin(const uint8_t* data, size_t size, const std::string& name) {
  PickleParser parser(data, size, name);
  const Value top = parser.run();
  auto bad = [&](const std::string& what) {
    return runtime_error(name, ": not an insightface verification .bin: ", what);
  };
  if ((top.kind != Value::Tuple && top.kind != Value::List) || top.items->size() != 2) {
    throw bad(detail::concat("expected a pair (bins, issame_list), got a ", kind_name(top.kind),
                             top.items ? detail::concat(" of ", top.items->size(), " items") : std::string()));
  }
  const Value& bins = (*top.items)[0];
  const Value& same = (*top.items)[1];
  if (bins.kind != Value::List && bins.kind != Value::Tuple) throw bad("bins is not a list");
  if (same.kind != Value::List && same.kind != Value::Tuple) throw bad("issame_list is not a list");
  VerificationSet set;
  set.images.reserve(bins.items->size());
  // References to one image share its buffer; counted with repeats, the images may not
  // hold much more than the file does, or a small file could make its reader decode (and
  // a caller copy) the same large image millions of times.
  uint64_t referenced = 0;
  std::unordered_set<const void*> distinct;  // buffers: references to one image share one
  for (size_t i = 0; i < bins.items->size(); ++i) {
    const Value& v = (*bins.items)[i];
    if (v.kind == Value::Bytes) {
      set.images.emplace_back(v.bytes);
    } else if (v.kind == Value::Text) {
      set.images.emplace_back(parser.latin1(v));
    } else {
      throw bad(detail::concat("bins[", i, "] is a ", kind_name(v.kind), ", expected bytes"));
    }
    referenced += set.images.back().size();
    if (referenced > uint64_t(size) + kMaxRepeatedImageBytes) {
      throw bad(detail::concat("bins[0..", i, "] hold ", referenced, " bytes counted with repeats, more than the ",
                               size, "-byte file plus ", kMaxRepeatedImageBytes >> 20,
                               " MiB (the pickle references the same images over and over)"));
    }
    distinct.insert(&set.images.back().bytes());
  }
  // A repeated reference is 2 bytes of pickle but a decode and a forward pass like any
  // image: a few thousand references to one tiny JPEG would keep an evaluation busy for
  // minutes. Pairs that reuse their images a few times pass.
  const uint64_t repeats = set.images.size() - distinct.size();
  if (repeats > kMaxRepeatsPerImage * distinct.size() + kRepeatAllowance) {
    throw bad(detail::concat(set.images.size(), " image references to ", distinct.size(), " distinct images (",
                             repeats, " repeats, at most ", kMaxRepeatsPerImage, " per distinct image + ",
                             kRepeatAllowance, "): each repeat would be decoded and evaluated again"));
  }
  set.issame.reserve(same.items->size());
  for (size_t i = 0; i < same.items->size(); ++i) {
    const Value& v = (*same.items)[i];
    if (!((v.kind == Value::Bool || v.kind == Value::Int) && (v.number == 0 || v.number == 1))) {
      throw bad(detail::concat("issame_list[", i, "] is a ", kind_name(v.kind), ", expected a bool"));
    }
    set.issame.push_back(v.number != 0);
  }
  if (set.images.size() != 2 * set.issame.size()) {
    throw bad(detail::concat(set.images.size(), " images for ", set.issame.size(), " pairs (expected 2 per pair)"));
  }
  return set;
}

VerificationSet read_verification_bin(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw usage_error(path, ": cannot open verification set (.bin)");
  std::vector<uint8_t> data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw runtime_error(path, ": read error");
  return parse_verification_bin(data.data(), data.size(), path);
}

std::vector<uint8_t> encode_verification_bin(const VerificationSet& set) {
  if (set.images.size() != 2 * set.issame.size()) {
    throw usage_error("verification .bin: ", set.images.size(), " images for ", set.issame.size(), " pairs");
  }
  std::vector<uint8_t> out = {0x80, 3};
  auto put32 = [&](uint32_t v) {
    for (int i = 0; i < 4; ++i) out.push_back(uint8_t(v >> (8 * i)));
  };
  // Lists are written like pickle's batched_appends: EMPTY_LIST, then MARK ... APPENDS
  // per 1000 items.
  auto put_list = [&](size_t n, auto&& put_item) {
    out.push_back(']');
    for (size_t start = 0; start < n; start += 1000) {
      const size_t end = std::min(n, start + 1000);
      out.push_back('(');
      for (size_t i = start; i < end; ++i) put_item(i);
      out.push_back('e');
    }
  };
  put_list(set.images.size(), [&](size_t i) {
    const auto& b = set.images[i];
    if (b.size() > 0xffffffffull) throw usage_error("verification .bin: image ", i, " larger than 4 GiB");
    if (b.size() < 256) {
      out.push_back('C');
      out.push_back(uint8_t(b.size()));
    } else {
      out.push_back('B');
      put32(uint32_t(b.size()));
    }
    out.insert(out.end(), b.begin(), b.end());
  });
  put_list(set.issame.size(), [&](size_t i) { out.push_back(set.issame[i] ? 0x88 : 0x89); });
  out.push_back(0x86);  // TUPLE2
  out.push_back('.');
  return out;
}

void write_verification_bin(const std::string& path, const VerificationSet& set) {
  const std::vector<uint8_t> bytes = encode_verification_bin(set);
  const std::string tmp = detail::concat(path, ".tmp.", ::getpid());
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) throw usage_error(path, ": cannot create: ", std::strerror(errno));
  bool ok = std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
  ok = (std::fclose(f) == 0) && ok;
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    throw runtime_error(path, ": write failed: ", std::strerror(err));
  }
}

}  // namespace faceshard

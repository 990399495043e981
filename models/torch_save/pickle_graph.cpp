#include "models/torch_save/pickle_graph.h"

#include <cstdio>
#include <cstring>
#include <deque>
#include <unordered_map>

#include "base/error.h"

namespace faceshard {

const char* pickle_kind_name(PickleGraph::Kind k) {
  using K = PickleGraph::Kind;
  switch (k) {
    case K::None: return "None";
    case K::Bool: return "bool";
    case K::Int: return "int";
    case K::Float: return "float";
    case K::String: return "str";
    case K::Bytes: return "bytes";
    case K::Global: return "global";
    case K::Tuple: return "tuple";
    case K::List: return "list";
    case K::Dict: return "dict";
    case K::Call: return "call";
    case K::Object: return "object";
    case K::Persistent: return "persistent id";
  }
  return "?";
}

class PickleMachine {
 public:
  using Kind = PickleGraph::Kind;
  using Node = PickleGraph::Node;

  PickleMachine(const uint8_t* data, size_t size, const std::string& context, const PickleLimits& limits)
      : p_(data), n_(size), context_(context), limits_(limits) {
    // Shared scalars: None, False, True and the empty tuple are one object each.
    none_ = make(Kind::None);
    false_ = make(Kind::Bool);
    true_ = make(Kind::Bool);
    at(true_).i = 1;
    empty_tuple_ = make(Kind::Tuple);
    at(empty_tuple_).depth = 1;
  }

  PickleGraph run() {
    while (true) {
      op_at_ = pos_;
      const uint8_t op = u8();
      switch (op) {
        case 0x80: {  // PROTO
          const uint8_t proto = u8();
          if (proto > 5) fail("unsupported pickle protocol " + std::to_string(proto));
          break;
        }
        case 0x95: {  // FRAME: a length hint; the opcodes inside are read as usual
          const uint64_t len = le(8);
          if (len > n_ - pos_) fail("frame runs past the end of the data");
          break;
        }
        case '.': return stop();  // STOP
        case '(':                 // MARK
          check_stack_room();
          marks_.push_back(stack_.size());
          break;
        case '0': pop(); break;              // POP
        case '1': pop_mark(); break;         // POP_MARK
        case '2': push(top()); break;        // DUP
        case 'N': push(none_); break;        // NONE
        case 0x88: push(true_); break;       // NEWTRUE
        case 0x89: push(false_); break;      // NEWFALSE
        case 'J': push_int(int32_t(uint32_t(le(4)))); break;  // BININT
        case 'K': push_int(int64_t(le(1))); break;            // BININT1
        case 'M': push_int(int64_t(le(2))); break;            // BININT2
        case 0x8a: push_int(long_le(u8())); break;            // LONG1
        case 0x8b: push_int(long_le(le(4))); break;           // LONG4
        case 'G': {                                           // BINFLOAT (big-endian)
          uint64_t bits = 0;
          for (const uint8_t* b = bytes(8), *e = b + 8; b < e; ++b) bits = (bits << 8) | *b;
          const uint32_t id = make(Kind::Float);
          std::memcpy(&at(id).f, &bits, 8);
          push(id);
          break;
        }
        case 'X': push_str(Kind::String, le(4)); break;   // BINUNICODE
        case 0x8c: push_str(Kind::String, u8()); break;   // SHORT_BINUNICODE
        case 0x8d: push_str(Kind::String, le(8)); break;  // BINUNICODE8
        case 'T': {                                       // BINSTRING (signed length)
          const int32_t len = int32_t(uint32_t(le(4)));
          if (len < 0) fail("negative string length");
          push_str(Kind::String, uint64_t(len));
          break;
        }
        case 'U': push_str(Kind::String, u8()); break;    // SHORT_BINSTRING
        case 'B': push_str(Kind::Bytes, le(4)); break;    // BINBYTES
        case 'C': push_str(Kind::Bytes, u8()); break;     // SHORT_BINBYTES
        case 0x8e: push_str(Kind::Bytes, le(8)); break;   // BINBYTES8
        case 0x96: push_str(Kind::Bytes, le(8)); break;   // BYTEARRAY8
        case ')': push(empty_tuple_); break;              // EMPTY_TUPLE
        case 0x85: case 0x86: case 0x87: {                // TUPLE1..3
          const size_t k = size_t(op - 0x84);
          const size_t floor = marks_.empty() ? 0 : marks_.back();
          if (stack_.size() < floor + k) fail("stack underflow");
          push_container(Kind::Tuple, stack_.size() - k);
          break;
        }
        case 't': push_container(Kind::Tuple, pop_mark_position()); break;  // TUPLE
        case ']': push(make_container(Kind::List)); break;                   // EMPTY_LIST
        case 'l': push_container(Kind::List, pop_mark_position()); break;    // LIST
        case '}': push(make_container(Kind::Dict)); break;                   // EMPTY_DICT
        case 'd': {                                                          // DICT
          const size_t m = pop_mark_position();
          if ((stack_.size() - m) % 2) fail("odd number of dict items");
          push_container(Kind::Dict, m);
          break;
        }
        case 'a': {  // APPEND
          const uint32_t v = pop();
          add_items(target(Kind::List), &v, 1);
          break;
        }
        case 'e': {  // APPENDS
          const size_t m = pop_mark_position();
          add_from_stack(Kind::List, m);
          break;
        }
        case 's': {  // SETITEM
          const uint32_t v = pop();
          const uint32_t k = pop();
          const uint32_t kv[2] = {k, v};
          add_items(target(Kind::Dict), kv, 2);
          break;
        }
        case 'u': {  // SETITEMS
          const size_t m = pop_mark_position();
          if ((stack_.size() - m) % 2) fail("odd number of dict items");
          add_from_stack(Kind::Dict, m);
          break;
        }
        case 'c': {  // GLOBAL "module\nname\n"
          std::string module = line();
          const std::string name = line();
          module += '.';
          module += name;
          push_global(std::move(module));
          break;
        }
        case 0x93: {  // STACK_GLOBAL
          const uint32_t name = pop();
          const uint32_t module = pop();
          if (at(name).kind != Kind::String || at(module).kind != Kind::String)
            fail("STACK_GLOBAL expects two strings");
          if (at(name).s.size() > 256 || at(module).s.size() > 256) fail("STACK_GLOBAL name too long");
          push_global(at(module).s + "." + at(name).s);
          break;
        }
        case 'R': {  // REDUCE
          const uint32_t args = pop();
          const uint32_t callable = pop();
          push(reduce(callable, args));
          break;
        }
        case 0x81: {  // NEWOBJ
          const uint32_t args = pop();
          const uint32_t cls = pop();
          const uint32_t o = make_container(Kind::Object);
          if (at(cls).kind == Kind::Global) at(o).s = at(cls).s;
          const uint32_t ca[2] = {cls, args};
          add_items(o, ca, 2);
          push(o);
          break;
        }
        case 'b':  // BUILD: an object's state (an OrderedDict's _metadata, ...) is not kept
          pop();
          top();
          break;
        case 'Q': {  // BINPERSID
          const uint32_t pid = pop();
          const uint32_t r = make_container(Kind::Persistent);
          add_items(r, &pid, 1);
          push(r);
          break;
        }
        case 'q': memo_put(uint32_t(le(1))); break;         // BINPUT
        case 'r': memo_put(uint32_t(le(4))); break;         // LONG_BINPUT
        case 0x94: memo_put(uint32_t(memo_.size())); break;  // MEMOIZE
        case 'h': memo_get(uint32_t(le(1))); break;         // BINGET
        case 'j': memo_get(uint32_t(le(4))); break;         // LONG_BINGET
        default: {
          char hex[8];
          std::snprintf(hex, sizeof hex, "0x%02x", op);
          fail(std::string("unsupported pickle opcode ") + hex);
        }
      }
    }
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw runtime_error(context_, " offset ", op_at_, ": ", what);
  }

  Node& at(uint32_t id) { return nodes_[id]; }

  uint32_t make(Kind kind) {
    if (nodes_.size() >= limits_.max_objects)
      fail("more than " + std::to_string(limits_.max_objects) + " objects");
    nodes_.emplace_back();
    nodes_.back().kind = kind;
    return uint32_t(nodes_.size() - 1);
  }
  uint32_t make_container(Kind kind) {
    const uint32_t id = make(kind);
    at(id).depth = 1;
    return id;
  }
  static bool is_container(Kind k) { return k >= Kind::Tuple; }

  // Adds items to container `c`, keeping the graph acyclic and shallow (see PickleGraph).
  void add_items(uint32_t c, const uint32_t* items, size_t k) {
    for (size_t j = 0; j < k; ++j) {
      const uint32_t v = items[j];
      Node& child = at(v);
      if (is_container(child.kind)) {
        if (v == c) fail(std::string("a ") + pickle_kind_name(child.kind) + " inside itself");
        const int depth = child.depth + 1;
        if (depth > limits_.max_depth)
          fail("containers nested more than " + std::to_string(limits_.max_depth) + " deep");
        Node& parent = at(c);
        if (depth > parent.depth) {
          if (parent.contained)
            fail(std::string("a ") + pickle_kind_name(parent.kind) +
                 " that is already inside another container grows deeper");
          parent.depth = uint8_t(depth);
        }
        child.contained = true;
      }
    }
    std::vector<uint32_t>& dst = at(c).items;
    dst.insert(dst.end(), items, items + k);
  }

  // A new container of the stack items from position m on (they are popped).
  void push_container(Kind kind, size_t m) {
    const uint32_t c = make_container(kind);
    at(c).items.reserve(stack_.size() - m);
    add_items(c, stack_.data() + m, stack_.size() - m);
    stack_.resize(m);
    push(c);
  }
  // APPENDS / SETITEMS: the stack items from m on go into the container below them.
  void add_from_stack(Kind kind, size_t m) {
    if (m == 0 || (marks_.empty() ? false : m <= marks_.back())) fail("APPENDS/SETITEMS without a target");
    const uint32_t c = stack_[m - 1];
    if (at(c).kind != kind)
      fail(std::string("expected a ") + pickle_kind_name(kind) + " to add items to, got a " +
           pickle_kind_name(at(c).kind));
    add_items(c, stack_.data() + m, stack_.size() - m);
    stack_.resize(m);
  }
  uint32_t target(Kind kind) {
    const uint32_t c = top();
    if (at(c).kind != kind)
      fail(std::string("expected a ") + pickle_kind_name(kind) + " on the stack, got a " +
           pickle_kind_name(at(c).kind));
    return c;
  }

  uint32_t reduce(uint32_t callable, uint32_t args) {
    const Node& fn = at(callable);
    if (fn.kind == Kind::Global &&
        (fn.s == "collections.OrderedDict" || fn.s == "builtins.dict" || fn.s == "__builtin__.dict")) {
      const uint32_t d = make_container(Kind::Dict);
      // OrderedDict([(k, v), ...]) in hand-written pickles; torch.save uses SETITEMS.
      const Node& a = at(args);
      if (a.kind == Kind::Tuple && !a.items.empty() && at(a.items[0]).kind == Kind::List) {
        const std::vector<uint32_t> pairs = at(a.items[0]).items;  // copy: add_items may grow nodes_
        for (uint32_t kv : pairs) {
          if (at(kv).kind != Kind::Tuple || at(kv).items.size() != 2) continue;
          const uint32_t two[2] = {at(kv).items[0], at(kv).items[1]};
          add_items(d, two, 2);
        }
      }
      return d;
    }
    const uint32_t c = make_container(Kind::Call);
    const uint32_t ca[2] = {callable, args};
    add_items(c, ca, 2);
    return c;
  }

  void push_global(std::string name) {
    const uint32_t g = make(Kind::Global);
    at(g).s = std::move(name);
    push(g);
  }

  uint8_t u8() {
    if (pos_ >= n_) fail("truncated pickle data");
    return p_[pos_++];
  }
  const uint8_t* bytes(uint64_t k) {
    if (k > n_ - pos_) fail("truncated pickle data");
    const uint8_t* r = p_ + pos_;
    pos_ += size_t(k);
    return r;
  }
  uint64_t le(size_t k) {
    const uint8_t* b = bytes(k);
    uint64_t v = 0;
    for (size_t j = 0; j < k; ++j) v |= uint64_t(b[j]) << (8 * j);
    return v;
  }
  int64_t long_le(uint64_t k) {
    if (k > 8) fail("integer wider than 64 bits");
    if (k == 0) return 0;
    uint64_t v = le(size_t(k));
    if (k < 8 && ((v >> (8 * k - 1)) & 1)) v |= ~uint64_t{0} << (8 * k);  // sign-extend
    return int64_t(v);
  }
  std::string line() {
    const size_t start = pos_;
    while (pos_ < n_ && p_[pos_] != '\n') {
      if (pos_ - start >= 256) fail("GLOBAL name longer than 256 bytes");
      ++pos_;
    }
    if (pos_ >= n_) fail("truncated pickle data");
    std::string s(reinterpret_cast<const char*>(p_ + start), pos_ - start);
    ++pos_;
    return s;
  }

  void push_int(int64_t v) {
    const uint32_t id = make(Kind::Int);
    at(id).i = v;
    push(id);
  }
  void push_str(Kind kind, uint64_t len) {
    const uint8_t* b = bytes(len);  // checked against the remaining bytes before allocating
    const uint32_t id = make(kind);
    at(id).s.assign(reinterpret_cast<const char*>(b), size_t(len));
    push(id);
  }

  void check_stack_room() {
    if (stack_.size() + marks_.size() >= limits_.max_stack)
      fail("pickle stack grows past " + std::to_string(limits_.max_stack) + " entries");
  }
  void push(uint32_t id) {
    check_stack_room();
    stack_.push_back(id);
  }
  uint32_t pop() {
    const size_t floor = marks_.empty() ? 0 : marks_.back();
    if (stack_.size() <= floor) fail("stack underflow");
    const uint32_t v = stack_.back();
    stack_.pop_back();
    return v;
  }
  uint32_t top() {
    const size_t floor = marks_.empty() ? 0 : marks_.back();
    if (stack_.size() <= floor) fail("stack underflow");
    return stack_.back();
  }
  size_t pop_mark_position() {
    if (marks_.empty()) fail("no MARK on the stack");
    const size_t m = marks_.back();
    marks_.pop_back();
    return m;
  }
  void pop_mark() { stack_.resize(pop_mark_position()); }

  void memo_put(uint32_t index) {
    const uint32_t v = top();
    auto it = memo_.find(index);
    if (it != memo_.end()) {
      it->second = v;
      return;
    }
    if (memo_.size() >= limits_.max_memo) fail("pickle memo grows past " + std::to_string(limits_.max_memo) + " entries");
    memo_.emplace(index, v);
  }
  void memo_get(uint32_t index) {
    auto it = memo_.find(index);
    if (it == memo_.end()) fail("memo entry " + std::to_string(index) + " read before it was stored");
    push(it->second);
  }

  PickleGraph stop() {
    if (!marks_.empty() || stack_.size() != 1) fail("stack not balanced at STOP");
    PickleGraph g;
    g.root_ = stack_.back();
    g.nodes_ = std::move(nodes_);
    return g;
  }

  const uint8_t* p_;
  size_t n_;
  size_t pos_ = 0;
  size_t op_at_ = 0;
  const std::string& context_;
  PickleLimits limits_;
  std::deque<Node> nodes_;
  std::vector<uint32_t> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint32_t, uint32_t> memo_;
  uint32_t none_ = 0, false_ = 0, true_ = 0, empty_tuple_ = 0;
};

PickleGraph parse_pickle(const uint8_t* data, size_t size, const std::string& context, const PickleLimits& limits) {
  return PickleMachine(data, size, context, limits).run();
}

}  // namespace faceshard

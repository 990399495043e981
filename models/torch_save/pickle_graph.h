// A bounded pickle machine: it runs the opcodes of a pickle (protocols 2-5, the subset
// torch.save emits and a little more), calls nothing, and returns the object graph the
// pickle describes. Plain C++ (no LibTorch): it parses untrusted files, so it is also built
// into the AddressSanitizer tests and a fuzz target.
#pragma once
#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <vector>

namespace faceshard {

struct PickleLimits {
  // Containers nested more deeply than this are refused (torch.save's state_dicts nest 4).
  int max_depth = 32;
  // Objects in the graph: about 20 per tensor in a state_dict, so 2M objects are 100k
  // tensors. Each costs at most 80 bytes plus its string bytes.
  size_t max_objects = size_t(1) << 21;
  // Pickle stack entries plus open MARKs, and memo entries.
  size_t max_stack = size_t(1) << 20;
  size_t max_memo = size_t(1) << 21;
};

// The objects live in one array and refer to each other by index, so building and freeing
// a graph never recurses, whatever its shape. Memo references share an object (a GET of a
// large string adds an index, not a copy). Containers are kept acyclic and at most
// max_depth deep while they are built: a container that is already inside another may
// not grow deeper afterwards, and none may contain itself.
//
// Memory: at most one new object per opcode, and every opcode is at least one byte, so
// building from n pickle bytes allocates at most about 150 n bytes (an 80-byte object,
// its string bytes, edges, stack and memo entries per byte), and never more than about
// 150 * max_objects bytes (300 MB) whatever n is.
class PickleGraph {
 public:
  enum class Kind : uint8_t {
    None, Bool, Int, Float, String, Bytes,  // scalars
    Global,                                 // "module.name" of GLOBAL / STACK_GLOBAL
    Tuple, List, Dict,                      // Dict: items = k0, v0, k1, v1, ... in insertion order
    Call,                                   // REDUCE: items = callable, args
    Object,                                 // NEWOBJ: items = class, args; s = class name
    Persistent,                             // BINPERSID: items = persistent id
  };
  struct Node {
    Kind kind = Kind::None;
    uint8_t depth = 0;       // containers: 1 + the deepest container inside; scalars 0
    bool contained = false;  // already an element of a container
    int64_t i = 0;           // Bool, Int
    double f = 0;            // Float
    std::string s;           // String, Bytes (raw bytes), Global and Object ("module.name")
    std::vector<uint32_t> items;
  };

  uint32_t root() const { return root_; }
  const Node& at(uint32_t id) const { return nodes_[id]; }
  size_t size() const { return nodes_.size(); }

 private:
  friend class PickleMachine;
  std::deque<Node> nodes_;  // a deque: growing it never copies the objects
  uint32_t root_ = 0;
};

const char* pickle_kind_name(PickleGraph::Kind kind);

// Runs the pickle in [data, data + size) up to its STOP. Throws faceshard::Error (runtime)
// "<context> offset N: <what>" for a malformed or truncated pickle, an opcode outside the
// supported set, or a limit exceeded.
PickleGraph parse_pickle(const uint8_t* data, size_t size, const std::string& context, const PickleLimits& limits = {});

}  // namespace faceshard

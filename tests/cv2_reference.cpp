#include "tests/cv2_reference.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <sstream>
#include <stdexcept>

#include "tests/test_paths.h"

namespace faceshard::testing {
namespace {

// The server: one request per header line (+ payload), one reply per request.
//   E ext rows cols channels depth n p1..pn nbytes  + pixels -> OK nbytes + file bytes
//   D flags nbytes + file bytes                             -> OK rows cols channels depth nbytes + pixels | NONE
//   R flags path                                            -> the same as D
// Errors reply "ERR message".
const char* kServer = R"PY(
import sys
import numpy as np
import cv2
r, w = sys.stdin.buffer, sys.stdout.buffer
depths = {0: np.uint8, 2: np.uint16}
def send(head, data=b""):
    w.write(head.encode() + b"\n")
    w.write(data)
    w.flush()
def send_image(img):
    if img is None:
        return send("NONE")
    img = np.ascontiguousarray(img)
    ch = 1 if img.ndim == 2 else img.shape[2]
    depth = {np.dtype(np.uint8): 0, np.dtype(np.uint16): 2}[img.dtype]
    b = img.tobytes()
    send(f"OK {img.shape[0]} {img.shape[1]} {ch} {depth} {len(b)}", b)
while True:
    line = r.readline()
    if not line:
        break
    f = line.rstrip(b"\n").split(b" ")
    try:
        if f[0] == b"E":
            ext = f[1].decode()
            rows, cols, ch, depth, n = map(int, f[2:7])
            params = [int(x) for x in f[7:7 + n]]
            data = r.read(int(f[7 + n]))
            a = np.frombuffer(data, depths[depth]).reshape((rows, cols, ch) if ch > 1 else (rows, cols))
            ok, buf = cv2.imencode(ext, a, params)
            if not ok:
                send("ERR cv2.imencode returned False")
            else:
                b = buf.tobytes()
                send(f"OK {len(b)}", b)
        elif f[0] == b"D":
            data = r.read(int(f[2]))
            send_image(cv2.imdecode(np.frombuffer(data, np.uint8), int(f[1])))
        elif f[0] == b"R":
            path = line.rstrip(b"\n").split(b" ", 2)[2].decode()
            send_image(cv2.imread(path, int(f[1])))
        else:
            send("ERR unknown request")
    except Exception as e:
        send("ERR " + repr(e).replace("\n", " "))
)PY";

class Server {
 public:
  Server() {
    int to[2], from[2];
    if (::pipe(to) != 0 || ::pipe(from) != 0) throw std::runtime_error("cv2 reference: pipe() failed");
    pid_ = ::fork();
    if (pid_ < 0) throw std::runtime_error("cv2 reference: fork() failed");
    if (pid_ == 0) {
      ::dup2(to[0], 0);
      ::dup2(from[1], 1);
      ::close(to[0]), ::close(to[1]), ::close(from[0]), ::close(from[1]);
      const char* py = python();
      ::execlp(py, py, "-c", kServer, static_cast<char*>(nullptr));
      std::fprintf(stderr, "cv2 reference: cannot run %s\n", py);
      ::_exit(127);
    }
    ::close(to[0]), ::close(from[1]);
    in_ = ::fdopen(to[1], "wb");
    out_ = ::fdopen(from[0], "rb");
    owner_ = ::getpid();
  }
  ~Server() {
    if (owner_ != ::getpid()) return;  // a forked child leaves its parent's server alone
    std::fclose(in_);
    std::fclose(out_);
    int status = 0;
    ::waitpid(pid_, &status, 0);
  }
  bool owned() const { return owner_ == ::getpid(); }

  // Sends a request; returns the reply's header fields after "OK" and its payload.
  std::pair<std::vector<long long>, std::vector<uint8_t>> call(const std::string& head, const uint8_t* data,
                                                                size_t size, int payload_field) {
    if (std::fwrite(head.data(), 1, head.size(), in_) != head.size() || std::fputc('\n', in_) == EOF ||
        (size && std::fwrite(data, 1, size, in_) != size) || std::fflush(in_) != 0)
      throw std::runtime_error(std::string("cv2 reference: cannot write to ") + python() + " (is cv2 installed?)");
    std::string line;
    for (int c; (c = std::fgetc(out_)) != '\n';) {
      if (c == EOF) throw std::runtime_error(std::string("cv2 reference: ") + python() + " -c 'import cv2' exited");
      line.push_back(char(c));
    }
    if (line == "NONE") return {{}, {}};
    if (line.rfind("OK ", 0) != 0) throw std::runtime_error("cv2 reference: " + line);
    std::istringstream ss(line.substr(3));
    std::vector<long long> fields;
    for (long long v; ss >> v;) fields.push_back(v);
    std::vector<uint8_t> payload(size_t(fields.at(size_t(payload_field))));
    if (!payload.empty() && std::fread(payload.data(), 1, payload.size(), out_) != payload.size())
      throw std::runtime_error("cv2 reference: short reply");
    return {fields, payload};
  }

 private:
  pid_t pid_ = -1, owner_ = -1;
  std::FILE* in_ = nullptr;
  std::FILE* out_ = nullptr;
};

Server& server() {
  static std::unique_ptr<Server> s;
  if (!s || !s->owned()) {
    if (s) (void)s.release();  // a forked child: its parent's pipes are not its own
    s = std::make_unique<Server>();
  }
  return *s;
}

cv::Mat image_of(const std::pair<std::vector<long long>, std::vector<uint8_t>>& reply) {
  const auto& [f, pixels] = reply;
  if (f.empty()) return {};
  cv::Mat m(static_cast<int>(f[0]), static_cast<int>(f[1]), CV_MAKETYPE(static_cast<int>(f[3]), static_cast<int>(f[2])));
  if (m.total() * m.elemSize() != pixels.size()) throw std::runtime_error("cv2 reference: image size mismatch");
  std::memcpy(m.data, pixels.data(), pixels.size());
  return m;
}

}  // namespace

std::vector<uint8_t> cv2_imencode(const std::string& ext, const cv::Mat& m, const std::vector<int>& params) {
  const cv::Mat c = m.isContinuous() ? m : m.clone();
  std::ostringstream head;
  head << "E " << ext << " " << c.rows << " " << c.cols << " " << c.channels() << " " << c.depth() << " "
       << params.size();
  for (int p : params) head << " " << p;
  const size_t bytes = c.total() * c.elemSize();
  head << " " << bytes;
  return server().call(head.str(), c.data, bytes, 0).second;
}

cv::Mat cv2_imdecode(const uint8_t* data, size_t size, int flags) {
  return image_of(server().call("D " + std::to_string(flags) + " " + std::to_string(size), data, size, 4));
}

cv::Mat cv2_imdecode(const std::vector<uint8_t>& bytes, int flags) {
  return cv2_imdecode(bytes.data(), bytes.size(), flags);
}

cv::Mat cv2_imread(const std::string& path, int flags) {
  return image_of(server().call("R " + std::to_string(flags) + " " + path, nullptr, 0, 4));
}

}  // namespace faceshard::testing

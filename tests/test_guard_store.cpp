// The rendezvous store that lets in the job's members only (guard_store.h), its hash
// (sha256.h), the job token's sources (job_token.h) and the guard on Gloo's ports
// (gloo_port_guard.h).
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <random>
#include <thread>

#include "base/error.h"
#include "partial_fc/distributed/gloo_port_guard.h"
#include "partial_fc/distributed/guard_store.h"
#include "partial_fc/distributed/job_token.h"
#include "partial_fc/distributed/network.h"
#include "base/sha256.h"
#include "tests/harness.h"

using namespace faceshard;
using Clock = std::chrono::steady_clock;

namespace {

std::string hex(const Digest256& d) { return to_hex(d.data(), d.size()); }

std::shared_ptr<GuardStoreServer> start_server(const std::string& token) {
  return std::make_shared<GuardStoreServer>(listen_socket("127.0.0.1", 0), token);
}

std::vector<uint8_t> b(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }
std::string s(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }

int connect_raw(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  ::inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Seconds until the far end closes `fd` (what arrives meanwhile is read, and counted in
// *received), or -1 when it is still open after `limit_s`.
double seconds_until_closed(int fd, Clock::time_point since, double limit_s, size_t* received = nullptr) {
  char buf[4096];
  for (;;) {
    const double left = limit_s - std::chrono::duration<double>(Clock::now() - since).count();
    if (left <= 0) return -1;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left * 1000) + 1) <= 0) continue;
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) return std::chrono::duration<double>(Clock::now() - since).count();
    if (received) *received += static_cast<size_t>(n);
  }
}

}  // namespace

// --- the hash: published test vectors (FIPS 180-4 examples, RFC 4231) --------------------

TEST(Sha256, MatchesThePublishedVectors) {
  EXPECT_EQ(hex(sha256("")), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(hex(sha256("abc")), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(hex(sha256("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq")),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  // A million 'a', fed in uneven pieces (the block boundary falls inside updates).
  Sha256 h;
  const std::string chunk(997, 'a');
  size_t left = 1000000;
  while (left > 0) {
    const size_t n = std::min(left, chunk.size());
    h.update(chunk.data(), n);
    left -= n;
  }
  EXPECT_EQ(hex(h.finish()), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(Sha256, HmacMatchesRfc4231) {
  EXPECT_EQ(hex(hmac_sha256(std::string(20, '\x0b'), "Hi There")),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  EXPECT_EQ(hex(hmac_sha256("Jefe", "what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  // A key longer than the block is hashed first.
  EXPECT_EQ(hex(hmac_sha256(std::string(131, '\xaa'), "Test Using Larger Than Block-Size Key - Hash Key First")),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
}

// --- the token's sources ----------------------------------------------------------------

TEST(JobToken, FileMustBePrivateAndIsTrimmed) {
  const std::string dir = faceshard::testing::temp_dir("token");
  const std::string path = dir + "/token";
  faceshard::testing::write_text(path, "s3cret value\n\n");
  ::chmod(path.c_str(), 0644);
  try {
    read_job_token(nullptr, path.c_str());
    FAIL() << "a token file readable by others was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.exit_code(), 2);
    EXPECT_NE(std::string(e.what()).find("readable by others (mode 0644): make it private with chmod 600"),
              std::string::npos)
        << e.what();
  }
  ::chmod(path.c_str(), 0600);
  const JobToken t = read_job_token(nullptr, path.c_str());
  EXPECT_EQ(t.secret, "s3cret value");
  EXPECT_EQ(t.source, "FACESHARD_JOB_TOKEN_FILE (" + path + ")");
  EXPECT_EQ(read_job_token("abc", nullptr).secret, "abc");
  EXPECT_TRUE(read_job_token(nullptr, "").empty());
  EXPECT_THROW(read_job_token("abc", path.c_str()), Error);
  EXPECT_THROW(read_job_token(nullptr, (dir + "/missing").c_str()), Error);
  faceshard::testing::write_text(path, " \n");
  ::chmod(path.c_str(), 0600);
  EXPECT_THROW(read_job_token(nullptr, path.c_str()), Error);
  EXPECT_THROW(read_job_token(nullptr, dir.c_str()), Error);  // a folder
}

// --- the store's semantics: the same answers as c10d's in-memory HashStore ----------------

TEST(GuardStore, AnswersLikeTorchsHashStore) {
  auto server = start_server("tok");
  GuardStore g("127.0.0.1", server->port(), "tok", std::chrono::seconds(10), server);
  c10d::HashStore ref;
  std::mt19937 rng(20261127);
  const std::vector<std::string> keys = {"a", "b", "c", "d/e", std::string("\0x", 2), ""};
  const std::vector<std::string> counters = {"n0", "n1", "n2"};
  auto pick = [&](const std::vector<std::string>& v) { return v[rng() % v.size()]; };
  auto value = [&] {
    std::string v(rng() % 12, '\0');
    for (auto& c : v) c = static_cast<char>(rng() % 256);
    return v;
  };
  for (int i = 0; i < 3000; ++i) {
    const int op = static_cast<int>(rng() % 10);
    const std::string k = pick(keys);
    SCOPED_TRACE("op " + std::to_string(op) + " #" + std::to_string(i));
    switch (op) {
      case 0: {
        const std::string v = value();
        g.set(k, b(v));
        ref.set(k, b(v));
        break;
      }
      case 1:
        if (ref.check({k})) ASSERT_EQ(s(g.get(k)), s(ref.get(k)));
        break;
      case 2: {
        const int64_t d = static_cast<int64_t>(rng() % 2001) - 1000;
        const std::string c = pick(counters);
        ASSERT_EQ(g.add(c, d), ref.add(c, d));
        break;
      }
      case 3: {
        // Expected: the current value, another value, or empty (absent key).
        std::string expected = rng() % 3 == 0 ? "" : rng() % 2 && ref.check({k}) ? s(ref.get(k)) : value();
        const std::string desired = value();
        ASSERT_EQ(s(g.compareSet(k, b(expected), b(desired))), s(ref.compareSet(k, b(expected), b(desired))));
        break;
      }
      case 4: {
        const std::vector<std::string> ks = {k, pick(keys)};
        ASSERT_EQ(g.check(ks), ref.check(ks));
        break;
      }
      case 5:
        ASSERT_EQ(g.deleteKey(k), ref.deleteKey(k));
        break;
      case 6:
        ASSERT_EQ(g.getNumKeys(), ref.getNumKeys());
        break;
      case 7: {
        std::vector<std::string> ks;
        for (const auto& x : keys)
          if (ref.check({x}) && rng() % 2) ks.push_back(x);
        const auto got = g.multiGet(ks), want = ref.multiGet(ks);
        ASSERT_EQ(got.size(), want.size());
        for (size_t j = 0; j < got.size(); ++j) ASSERT_EQ(s(got[j]), s(want[j]));
        break;
      }
      case 8: {
        const std::vector<std::string> ks = {k, pick(keys)};
        const std::vector<std::vector<uint8_t>> vs = {b(value()), b(value())};
        g.multiSet(ks, vs);
        ref.multiSet(ks, vs);
        break;
      }
      case 9: {
        const std::string v = value();
        g.append(k, b(v));
        ref.append(k, b(v));
        break;
      }
    }
  }
  for (const auto& k : keys) {
    ASSERT_EQ(g.check({k}), ref.check({k}));
    if (ref.check({k})) EXPECT_EQ(s(g.get(k)), s(ref.get(k)));
  }
}

TEST(GuardStore, WaitsForKeysAndTimesOutWithoutLosingTheStore) {
  auto server = start_server("");
  GuardStore a("127.0.0.1", server->port(), "", std::chrono::seconds(10), server);
  GuardStore c("127.0.0.1", server->port(), "", std::chrono::seconds(10));
  std::thread setter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    c.set("late", b("here"));
    c.multiSet({"x", "y"}, {b("1"), b("2")});
  });
  EXPECT_EQ(s(a.get("late")), "here");  // held by the server until it exists
  const auto xy = a.multiGet({"x", "y"});
  setter.join();
  EXPECT_EQ(s(xy[0]) + s(xy[1]), "12");
  const auto t0 = Clock::now();
  EXPECT_THROW(a.wait({"never"}, std::chrono::milliseconds(300)), c10::DistStoreError);
  const double took = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_GE(took, 0.29);
  EXPECT_LT(took, 3.0);
  // The timed-out request's connection is gone; the next request connects afresh.
  a.set("after", b("ok"));
  EXPECT_EQ(s(c.get("after")), "ok");
  auto clone = a.clone();
  EXPECT_EQ(s(clone->get("x")), "1");
  // A set is not answered: one sent just before its member goes away still lands.
  for (int i = 0; i < 20; ++i) {
    GuardStore brief("127.0.0.1", server->port(), "", std::chrono::seconds(10));
    brief.set("last words " + std::to_string(i), b("bye"));
  }
  for (int i = 0; i < 20; ++i) EXPECT_EQ(s(a.get("last words " + std::to_string(i))), "bye");
}

// A member with the wrong token, or a process reaching another program's port, gets one line.
TEST(GuardStore, RefusesAWrongTokenAndSaysSo) {
  auto server = start_server("right");
  try {
    GuardStore bad("127.0.0.1", server->port(), "wrong", std::chrono::seconds(10));
    FAIL() << "a wrong token was let in";
  } catch (const c10::DistNetworkError& e) {
    EXPECT_NE(std::string(e.what()).find("refused this process: its job token"), std::string::npos) << e.what();
  }
  EXPECT_EQ(server->stats().members, 0);
  EXPECT_GE(server->stats().refused, 3);
  GuardStore good("127.0.0.1", server->port(), "right", std::chrono::seconds(10));
  good.set("k", b("v"));
  EXPECT_EQ(s(good.get("k")), "v");

  // Not a faceshard store: a listener that greets with something else.
  const int lfd = listen_socket("127.0.0.1", 0);
  sockaddr_in sa{};
  socklen_t len = sizeof sa;
  ::getsockname(lfd, reinterpret_cast<sockaddr*>(&sa), &len);
  std::thread other([lfd] {
    const int c = ::accept(lfd, nullptr, nullptr);
    const std::string junk(40, 'x');
    if (::send(c, junk.data(), junk.size(), MSG_NOSIGNAL) < 0) {
    }
    char buf[256];
    while (::recv(c, buf, sizeof buf, 0) > 0) {
    }
    ::close(c);
  });
  try {
    GuardStore lost("127.0.0.1", ntohs(sa.sin_port), "right", std::chrono::seconds(5));
    ADD_FAILURE() << "a stranger's port was taken for the store";
  } catch (const c10::DistNetworkError& e) {
    EXPECT_NE(std::string(e.what()).find("answered like no faceshard store"), std::string::npos) << e.what();
  }
  other.join();
  ::close(lfd);
}

// Strangers: idle connections by the hundred, random bytes, a length prefix of 2^63, a slow
// drip, a recorded handshake replayed. Each is closed within the handshake's deadline (plus
// slack for a loaded machine), and a member's requests are answered meanwhile.
TEST(GuardStore, StrangersAreClosedAndMembersServedMeanwhile) {
  auto server = start_server("job-secret");
  const int port = server->port();
  GuardStore member("127.0.0.1", port, "job-secret", std::chrono::seconds(10), server);

  // Record a member's handshake answer with a fake store, to replay it to the real one.
  const int lfd = listen_socket("127.0.0.1", 0);
  sockaddr_in sa{};
  socklen_t len = sizeof sa;
  ::getsockname(lfd, reinterpret_cast<sockaddr*>(&sa), &len);
  std::string recorded;
  std::thread fake([&] {
    const int c = ::accept(lfd, nullptr, nullptr);
    std::string greeting = std::string("FSGS\x01", 5) + std::string(32, '\x07');
    if (::send(c, greeting.data(), greeting.size(), MSG_NOSIGNAL) < 0) {
    }
    char buf[128];
    while (recorded.size() < 69) {
      const ssize_t n = ::recv(c, buf, sizeof buf, 0);
      if (n <= 0) break;
      recorded.append(buf, static_cast<size_t>(n));
    }
    ::close(c);
  });
  EXPECT_THROW(GuardStore("127.0.0.1", ntohs(sa.sin_port), "job-secret", std::chrono::seconds(2)), std::exception);
  fake.join();
  ::close(lfd);
  ASSERT_EQ(recorded.size(), 69u);

  // This machine's reaction time now (under whatever else runs): a wrong answer to the
  // greeting is refused as it arrives; how long that takes is the slack of the limit below.
  double react_s = 0;
  {
    const int fd = connect_raw(port);
    ASSERT_GE(fd, 0);
    const std::string wrong(69, 'x');
    const auto t0 = Clock::now();
    ASSERT_EQ(::send(fd, wrong.data(), wrong.size(), MSG_NOSIGNAL), static_cast<ssize_t>(wrong.size()));
    react_s = seconds_until_closed(fd, t0, 5.0);
    ASSERT_GE(react_s, 0) << "a wrong answer to the greeting was not refused within 5 s";
    ::close(fd);
  }
  struct Stranger {
    int fd;
    Clock::time_point opened;
    std::string what;
  };
  std::vector<Stranger> strangers;
  for (int i = 0; i < 300; ++i) strangers.push_back({connect_raw(port), Clock::now(), "idle"});
  std::mt19937 rng(5);
  for (int i = 0; i < 20; ++i) {
    std::string junk(1 + rng() % 8192, '\0');
    for (auto& c : junk) c = static_cast<char>(rng());
    const int fd = connect_raw(port);
    if (::send(fd, junk.data(), junk.size(), MSG_NOSIGNAL) < 0) {
    }
    strangers.push_back({fd, Clock::now(), "random"});
  }
  {
    const int fd = connect_raw(port);
    const uint64_t huge = uint64_t(1) << 63;
    if (::send(fd, &huge, sizeof huge, MSG_NOSIGNAL) < 0) {
    }
    strangers.push_back({fd, Clock::now(), "2^63"});
  }
  {
    const int fd = connect_raw(port);
    if (::send(fd, recorded.data(), recorded.size(), MSG_NOSIGNAL) < 0) {
    }
    strangers.push_back({fd, Clock::now(), "replay"});
  }
  // The slow drip: the start of a valid answer, a byte every 100 ms.
  const int drip = connect_raw(port);
  const auto drip_opened = Clock::now();
  std::thread dripper([drip] {
    const std::string start("FSGS\x01", 5);
    for (int i = 0; i < 30; ++i) {
      const char c = i < 5 ? start[i] : 'z';
      if (::send(drip, &c, 1, MSG_NOSIGNAL) < 0) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  });
  // A member is served while the strangers wait.
  for (int i = 0; i < 20; ++i) member.set("k" + std::to_string(i), b(std::to_string(i)));
  EXPECT_EQ(s(member.get("k19")), "19");

  // The handshake's deadline, and a slack of two of the server's poll periods (it looks at its
  // pending connections every 0.25 s at the latest) and ten reaction times.
  const double limit = std::chrono::duration<double>(kHandshakeDeadline).count() + 2 * 0.25 + 10 * react_s;
  for (auto& st : strangers) {
    ASSERT_GE(st.fd, 0);
    size_t received = 0;
    const double took = seconds_until_closed(st.fd, st.opened, limit, &received);
    EXPECT_GE(took, 0) << st.what << ": still open after " << limit << " s";
    // Refused, not let in: nothing came back beyond the greeting ("FSGS", version, a 32-byte
    // nonce: 37 bytes); a member gets the store's proof, 32 bytes more, after its answer, and
    // a replayed answer must not.
    EXPECT_LE(received, 37u) << st.what << ": got " << received << " bytes back";
    ::close(st.fd);
  }
  const double drip_took = seconds_until_closed(drip, drip_opened, limit);
  EXPECT_GE(drip_took, 0) << "the slow drip is still open";
  dripper.join();
  ::close(drip);
  EXPECT_EQ(server->stats().members, 1);  // the recording happened at the fake store
  EXPECT_EQ(s(member.get("k3")), "3");
  // Every stranger refused, by the server's count: the probe, the idle, random, 2^63 and
  // replayed ones and the drip; the recording's connection went to the fake store.
  EXPECT_EQ(server->stats().refused, 1 + 300 + 20 + 1 + 1 + 1);
}

// The guard on Gloo's ports: a connection accepted after the snapshot is shut down; the
// mesh's own connection (accepted before) stays.
TEST(GlooPortGuard, ShutsDownLaterConnectionsOnly) {
  const int lfd = listen_socket("127.0.0.1", 0);
  sockaddr_in sa{};
  socklen_t len = sizeof sa;
  ::getsockname(lfd, reinterpret_cast<sockaddr*>(&sa), &len);
  const int port = ntohs(sa.sin_port);
  const int mesh_out = connect_raw(port);
  const int mesh_in = ::accept(lfd, nullptr, nullptr);
  ASSERT_GE(mesh_in, 0);
  const auto period = std::chrono::milliseconds(50);
  GlooPortGuard guard({}, period);
  ASSERT_NE(std::find(guard.ports().begin(), guard.ports().end(), port), guard.ports().end());

  // This machine's reaction time now (under whatever else runs): a connection shut down by a
  // sweep called here, seen closed at the far end.
  double react_s = 0;
  {
    const int probe = connect_raw(port);
    const int probe_in = ::accept(lfd, nullptr, nullptr);
    ASSERT_GE(probe_in, 0);
    const auto t0 = Clock::now();
    guard.sweep();
    react_s = seconds_until_closed(probe, t0, 3.0);
    ASSERT_GE(react_s, 0) << "a sweep left a stranger's connection open";
    ::close(probe);
    ::close(probe_in);
  }
  const int stranger = connect_raw(port);
  const auto t0 = Clock::now();
  const int accepted = ::accept(lfd, nullptr, nullptr);  // what Gloo's listener does
  ASSERT_GE(accepted, 0);
  const double took = seconds_until_closed(stranger, t0, 3.0);
  EXPECT_GE(took, 0) << "the stranger's connection is still open";
  // Within one period of its arrival (the sweep that comes next), with a period's slack for a
  // late wake-up and ten reaction times.
  const double bound = 2 * std::chrono::duration<double>(period).count() + 10 * react_s;
  EXPECT_LT(took, bound) << "reaction " << react_s << " s";
  EXPECT_GE(guard.closed(), 2);
  // The mesh's connection still carries bytes both ways.
  const char ping = 'p';
  ASSERT_EQ(::send(mesh_out, &ping, 1, MSG_NOSIGNAL), 1);
  char got = 0;
  ASSERT_EQ(::recv(mesh_in, &got, 1, 0), 1);
  EXPECT_EQ(got, 'p');
  ASSERT_EQ(::send(mesh_in, &ping, 1, MSG_NOSIGNAL), 1);
  ASSERT_EQ(::recv(mesh_out, &got, 1, 0), 1);
  for (int fd : {stranger, accepted, mesh_in, mesh_out, lfd}) ::close(fd);
}

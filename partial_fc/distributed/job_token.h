// The job's token: the shared secret every member of a multi-process job presents to the
// rendezvous store (guard_store.h) before it is let in. It comes from FACESHARD_JOB_TOKEN
// (the secret itself) or FACESHARD_JOB_TOKEN_FILE (a file only this user can read); with
// neither, the token is empty: the store still refuses anything that is not a faceshard
// member (random bytes, scanners, a replayed handshake), but any faceshard process that
// reaches the port could join.
#pragma once
#include <string>

namespace faceshard {

struct JobToken {
  std::string secret;
  std::string source;  // "FACESHARD_JOB_TOKEN", "FACESHARD_JOB_TOKEN_FILE (path)" or "" (none)
  bool empty() const { return secret.empty(); }
};

// From the two values (nullptr or "" = unset). Usage error, one line, when both are set,
// the value is too long, or the file is missing, not a regular file, not this user's, readable
// by group or others, empty or larger than 4 KiB. The file's trailing white space is dropped.
JobToken read_job_token(const char* value, const char* file);
// read_job_token of this process's environment, read once (every store connection of the
// process presents the same token).
const JobToken& job_token();

}  // namespace faceshard

// The job secret: the key every process of one job (a trainer's ranks, the
// inference receivers it pushes to) shares and a stranger does not. The push
// server, the push receivers and the TCP transport prove knowledge of it to
// each other on every connection (sync/transport/auth_handshake.h) before
// anything else crosses it.
//
// Where it comes from, first found wins:
//   1. an argument (PushServerOptions::secret, ...; Python's secret=),
//   2. the environment: DTE_JOB_SECRET (the secret itself) or
//      DTE_JOB_SECRET_FILE (a file holding it),
//   3. the rendezvous directory's file "secret" (which a launcher keeps
//      private; the TCP transport's rank 0 creates one when none of the
//      above gives a secret).
// A secret file must belong to this user and be unreadable by group and
// others (mode 0600 or 0400); trailing white space is not part of the
// secret. A secret has at least kMinSecretBytes bytes.
//
// Thread-safety: pure functions (they read the environment).
#pragma once

#include <cstddef>
#include <optional>
#include <string>

#include "store/base/status.h"

namespace dte {

inline constexpr char kSecretFileName[] = "secret";
inline constexpr size_t kMinSecretBytes = 16;
inline constexpr char kSecretEnv[] = "DTE_JOB_SECRET";
inline constexpr char kSecretFileEnv[] = "DTE_JOB_SECRET_FILE";

struct JobSecret {
  std::string key;     // the secret's bytes
  std::string source;  // where it came from, for messages ("DTE_JOB_SECRET", "file /x/secret")
};

// The secret from `given`, the environment or `rendezvous_dir` (empty: no
// directory), in that order; nullopt when none has one. InvalidArgument for
// a secret too short, PermissionDenied for a file others may read (naming
// it and its mode), the read's error for a file that cannot be read.
Result<std::optional<JobSecret>> FindJobSecret(const std::string& given,
                                               const std::string& rendezvous_dir);

// Reads a secret file, checked as above.
Result<JobSecret> ReadSecretFile(const std::string& path);

// rendezvous_dir/secret: created (mode 0600, 32 random bytes written as
// hex) unless it exists, then read and checked as above.
Result<JobSecret> CreateRendezvousSecret(const std::string& rendezvous_dir);

// What to tell a user who must give a secret (the three ways), for errors.
std::string HowToGiveASecret();

// Without a secret a server listens on loopback only: InvalidArgument
// naming `what`, the address and how to give a secret for any other
// address ("0.0.0.0:29600", a host's own address).
Status CheckListenWithoutSecret(const std::string& address, const std::string& what);

}  // namespace dte

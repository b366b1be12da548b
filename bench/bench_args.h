// Minimal "--flag value" command-line walking shared by the bench programs.
#pragma once

#include <cstdlib>
#include <iostream>
#include <string>

namespace logprob {

/// Iterates over argv[1..]: Next() moves to the next argument (false at
/// the end), flag() is it, Value() consumes the following one (exits 2 with
/// a message when there is none).
class BenchArgs {
 public:
  BenchArgs(int argc, char** argv) : argc_(argc), argv_(argv) {}
  bool Next() { return ++i_ < argc_; }
  std::string flag() const { return argv_[i_]; }
  std::string Value() {
    if (i_ + 1 >= argc_) {
      std::cerr << argv_[i_] << " needs a value" << std::endl;
      std::exit(2);
    }
    return argv_[++i_];
  }

 private:
  int argc_;
  char** argv_;
  int i_ = 0;
};

}  // namespace logprob

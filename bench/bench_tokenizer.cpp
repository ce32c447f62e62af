// Encoding throughput of a tokenizer (data::Tokenizer) on one thread:
// the C++ half of scripts/bench-tokenizer.sh, whose other half is
// tests/tokenizers/reference.js in bench mode. Same output shape as that
// script: one JSON line with the bytes, the tokens and the seconds of each
// repeat. Each repeat builds a fresh tokenizer (outside the timing), so every
// repeat starts with an empty word cache, as a one-shot `prepare` does.
//
// usage: bench_tokenizer TOKENIZER TEXT_FILE [REPEATS [whole|lines]]
//   lines: encode line by line, each line with its newline (as reference.js does)
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "scaletrain/data/tokenizer.h"
#include "scaletrain/util/error.h"

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: bench_tokenizer TOKENIZER TEXT_FILE [REPEATS]\n");
    return 2;
  }
  try {
    std::ifstream in(argv[2], std::ios::binary);
    if (!in) throw scaletrain::UsageError(std::string("cannot read ") + argv[2]);
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string text = ss.str();
    const int repeats = argc > 3 ? std::atoi(argv[3]) : 5;
    const bool lines = argc > 4 && std::string(argv[4]) == "lines";
    std::vector<std::string_view> pieces;
    for (std::size_t at = 0; at < text.size();) {
      const std::size_t nl = lines ? text.find('\n', at) : std::string::npos;
      const std::size_t end = nl == std::string::npos ? text.size() : nl + 1;
      pieces.push_back(std::string_view(text).substr(at, end - at));
      at = end;
    }
    std::vector<double> seconds;
    std::size_t tokens = 0;
    for (int r = 0; r < repeats; ++r) {
      scaletrain::data::Tokenizer tok(argv[1]);
      std::vector<uint32_t> ids;
      ids.reserve(text.size() / 2);
      const auto t0 = std::chrono::steady_clock::now();
      for (std::string_view p : pieces) tok.encode_append(p, ids);
      seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      tokens = ids.size();
    }
    std::printf("{\"bytes\": %zu, \"tokens\": %zu, \"seconds\": [", text.size(), tokens);
    for (std::size_t i = 0; i < seconds.size(); ++i) std::printf("%s%.6f", i ? ", " : "", seconds[i]);
    std::printf("]}\n");
  } catch (const scaletrain::UsageError& e) {
    std::fprintf(stderr, "bench_tokenizer: %s\n", e.what());
    return 2;
  }
  return 0;
}

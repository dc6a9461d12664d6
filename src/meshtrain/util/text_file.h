// A small file's whole bytes (config.json, tokenizer.json, a chat template).
#pragma once

#include <string>

namespace meshtrain {

// Error (io) naming the path when it cannot be read.
std::string read_file_text(const std::string& path);

}  // namespace meshtrain

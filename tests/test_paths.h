// Where the test binary finds the project's files, its tools and Python, read at run time
// so that the same binary runs from a build tree and from an unpacked bundle
// (tools/bundle.sh): the environment first (FACESHARD_TEST_SOURCE_DIR, FACESHARD_TEST_BIN_DIR,
// FACESHARD_TEST_PYTHON, FACESHARD_TEST_FUZZ_SEEDS_DIR), then the file faceshard_tests.paths
// beside the binary (key=value lines: source, bin, python, fuzz_seeds), which CMake writes in
// a build tree and bundle.sh in a bundle. A relative path there is taken from the file's
// folder, except a bare command name for python (python=python3): looked up on the PATH.
#pragma once

namespace faceshard::testing {
const char* source_dir();      // the repository root (configs/, tools/, tests/)
const char* bin_dir();         // the faceshard-* tools
const char* python();          // a Python with torch (and numpy, cv2 for the image tests)
const char* fuzz_seeds_dir();  // where FuzzSeeds.* writes the fuzz targets' seeds
}  // namespace faceshard::testing

// The names the tests use. The AddressSanitizer build (tests/asan), which links no test
// library, defines its two as compile definitions instead.
#ifndef FACESHARD_SOURCE_DIR
#define FACESHARD_SOURCE_DIR ::faceshard::testing::source_dir()
#endif
#ifndef FACESHARD_BIN_DIR
#define FACESHARD_BIN_DIR ::faceshard::testing::bin_dir()
#endif
#ifndef FACESHARD_PYTHON
#define FACESHARD_PYTHON ::faceshard::testing::python()
#endif
#ifndef FACESHARD_FUZZ_SEEDS_DIR
#define FACESHARD_FUZZ_SEEDS_DIR ::faceshard::testing::fuzz_seeds_dir()
#endif

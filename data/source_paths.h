// The files a packed set was made from: faceshard-pack pack writes OUT_PREFIX.sources.tsv
// beside OUT_PREFIX.rec, one line per image in the set's image order ("index<TAB>label<TAB>
// path", the path as pack read it), so that what a tool reports of image i of the .rec
// (faceshard-clean's reports) can name the photo it came from. Only the lines' offsets are
// held (8 bytes an image); a path is read from the file when asked for.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace faceshard {

// "DIR/train.rec" -> "DIR/train.sources.tsv".
std::string sources_path_of(const std::string& rec_path);

class SourcePaths {
 public:
  // The sources file beside `rec_path`, checked to list `images` images in order; nothing
  // (null) when there is none. A file that is there but does not fit (another number of lines, a
  // row out of order, no header) is a usage error naming the file and line.
  static std::shared_ptr<const SourcePaths> open_beside(const std::string& rec_path, uint64_t images);
  SourcePaths(const SourcePaths&) = delete;
  SourcePaths& operator=(const SourcePaths&) = delete;
  ~SourcePaths();

  // Image `index`'s source path (thread-safe).
  std::string path(uint64_t index) const;
  const std::string& file() const { return file_; }

 private:
  SourcePaths() = default;
  std::string file_;
  int fd_ = -1;
  std::vector<uint64_t> offsets_;  // of each image's path, and one past the last line
};

// The identity names of a packed set's classes, from OUT_PREFIX.labels.tsv beside its .rec
// (faceshard-pack pack's `label<TAB>identity<TAB>images`, or a clean copy's `identities`
// column): names[c] for class c. Empty, with `problem` saying why, when there is no such file
// or it does not name each of the `classes` classes once.
struct IdentityNames {
  std::vector<std::string> names;
  std::string problem;
};
std::string labels_path_of(const std::string& rec_path);
IdentityNames identity_names_beside(const std::string& rec_path, int64_t classes);

}  // namespace faceshard

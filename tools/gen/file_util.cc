#include "tools/gen/file_util.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <system_error>

namespace dte::gen {

File::~File() {
  if (fd_ >= 0) ::close(fd_);
}

File::File(File&& other) noexcept : fd_(other.fd_), path_(std::move(other.path_)) {
  other.fd_ = -1;
}

File& File::operator=(File&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.fd_;
    path_ = std::move(other.path_);
    other.fd_ = -1;
  }
  return *this;
}

Result<File> File::Create(const std::string& path, uint64_t size) {
  File file;
  file.path_ = path;
  file.fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (file.fd_ < 0) return ErrnoStatus("create " + path, errno);
  if (::ftruncate(file.fd_, static_cast<off_t>(size)) != 0) {
    return ErrnoStatus("resize " + path, errno);
  }
  return file;
}

Status File::PwriteAll(std::span<const uint8_t> data, uint64_t offset) const {
  while (!data.empty()) {
    ssize_t n = ::pwrite(fd_, data.data(), data.size(), static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return ErrnoStatus("write " + path_, n < 0 ? errno : EIO);
    data = data.subspan(static_cast<size_t>(n));
    offset += static_cast<uint64_t>(n);
  }
  return Status::Ok();
}

Status File::Close() {
  if (fd_ < 0) return Status::Ok();
  int rc = ::close(fd_);
  fd_ = -1;
  if (rc != 0) return ErrnoStatus("close " + path_, errno);
  return Status::Ok();
}

Status WriteWholeFile(const std::string& path, const std::string& contents) {
  ASSIGN_OR_RETURN(File file, File::Create(path, contents.size()));
  RETURN_IF_ERROR(
      file.PwriteAll({reinterpret_cast<const uint8_t*>(contents.data()), contents.size()}, 0));
  return file.Close();
}

Status MakeDirs(const std::string& path) {
  std::error_code ec;
  std::filesystem::create_directories(path, ec);
  if (ec) return IOError("create directory " + path + ": " + ec.message());
  return Status::Ok();
}

Status RemoveStaleWeights(const std::string& dir) {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    bool weights = name.starts_with("model") &&
                   (name.ends_with(".safetensors") || name == "model.safetensors.index.json");
    if (weights && !std::filesystem::remove(entry.path(), ec)) break;
  }
  if (ec) return IOError("clean " + dir + ": " + ec.message());
  return Status::Ok();
}

}  // namespace dte::gen

// strict_driver.cpp: runs megakernel decode steps from a blob file, for ThreadSanitizer.
//
// TSan cannot be loaded into Python, so strict.py writes everything a KernelExecutor's launch
// touches into one blob file, and this driver (compiled after the generated megakernel source,
// with -DEMU_STRICT -fsanitize=thread, cuda_cpu.h force-included) runs the steps in its own
// process. The blob is little-endian:
//
//   BlobHeader, then at the offsets it names: the Params struct with every pointer field holding a
//   byte offset into the blob (0 = null), the byte offsets of those pointer fields within Params
//   (n_pointers x uint32), the control words to write before each step (steps x control_bytes),
//   and the buffers themselves in [data_offset, data_offset + data_bytes).
//
// Output file: OutHeader, then per completed step its control words and its logits, then the
// final data region. Exit status: 0 (the steps ran; the kernel's own error record is in the
// control words), 2 (bad input or I/O), 3 (the emulator reported an error, message on stderr).
//
// Usage: strict_driver BLOB OUT

namespace strict_driver {

constexpr char kBlobMagic[8] = {'M', 'K', 'S', 'T', 'R', 'I', 'C', 'T'};
constexpr char kOutMagic[8] = {'M', 'K', 'S', 'T', 'R', 'O', 'U', 'T'};
constexpr std::uint32_t kVersion = 1;

struct BlobHeader {
  char magic[8];
  std::uint32_t version, grid, block, steps;
  std::uint32_t params_size, n_pointers;
  std::uint64_t params_offset, pointers_offset, steps_offset;
  std::uint64_t control_offset, control_bytes, logits_offset, logits_bytes;
  std::uint64_t data_offset, data_bytes, blob_bytes;
  double timeout_s;
};

struct OutHeader {
  char magic[8];
  std::uint32_t steps_done, reserved;
};

[[noreturn]] void die(const char* what, const char* path) {
  std::fprintf(stderr, "strict_driver: %s: %s\n", what, path);
  std::exit(2);
}

bool inside(const BlobHeader& h, std::uint64_t off, std::uint64_t bytes) {
  return off <= h.blob_bytes && bytes <= h.blob_bytes - off;
}

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s BLOB OUT\n", argv[0]);
    return 2;
  }
  std::FILE* in = std::fopen(argv[1], "rb");
  if (!in) die("cannot open", argv[1]);
  std::fseek(in, 0, SEEK_END);
  const long size = std::ftell(in);
  std::fseek(in, 0, SEEK_SET);
  if (size < static_cast<long>(sizeof(BlobHeader))) die("too short for a blob header", argv[1]);
  // 4 KiB alignment: buffer offsets in the blob are 64-byte aligned, so the buffers are too.
  const std::size_t cap = (static_cast<std::size_t>(size) + 4095) & ~std::size_t{4095};
  char* blob = static_cast<char*>(std::aligned_alloc(4096, cap));
  if (!blob || std::fread(blob, 1, size, in) != static_cast<std::size_t>(size)) die("cannot read", argv[1]);
  std::fclose(in);

  BlobHeader h;
  std::memcpy(&h, blob, sizeof h);
  if (std::memcmp(h.magic, kBlobMagic, 8) != 0 || h.version != kVersion) die("not a version-1 strict blob", argv[1]);
  if (h.blob_bytes != static_cast<std::uint64_t>(size)) die("blob size does not match its header", argv[1]);
  if (h.params_size != sizeof(Params))
    die("Params size differs from this build's (the blob was written for another model or layout)", argv[1]);
  if (!inside(h, h.params_offset, h.params_size) || !inside(h, h.pointers_offset, 4ull * h.n_pointers) ||
      !inside(h, h.steps_offset, h.control_bytes * h.steps) || !inside(h, h.control_offset, h.control_bytes) ||
      !inside(h, h.logits_offset, h.logits_bytes) || !inside(h, h.data_offset, h.data_bytes))
    die("an offset in the header points outside the blob", argv[1]);

  Params params;
  std::memcpy(&params, blob + h.params_offset, sizeof params);
  for (std::uint32_t i = 0; i < h.n_pointers; ++i) {
    std::uint32_t field;
    std::memcpy(&field, blob + h.pointers_offset + 4ull * i, 4);
    if (field + 8ull > sizeof params) die("a pointer field lies outside Params", argv[1]);
    std::uint64_t value;
    std::memcpy(&value, reinterpret_cast<char*>(&params) + field, 8);
    if (value != 0) {
      if (value >= h.blob_bytes) die("a pointer field points outside the blob", argv[1]);
      value += reinterpret_cast<std::uintptr_t>(blob);
    }
    std::memcpy(reinterpret_cast<char*>(&params) + field, &value, 8);
  }

  std::vector<char> records;
  std::uint32_t done = 0;
  int code = 0;
  for (; done < h.steps; ++done) {
    std::memcpy(blob + h.control_offset, blob + h.steps_offset + h.control_bytes * done, h.control_bytes);
    code = emu::launch(&emu::kernel_entry<&megakernel>, static_cast<int>(h.grid), static_cast<int>(h.block), &params,
                       h.timeout_s);
    if (code != 0) {
      std::fprintf(stderr, "strict_driver: step %u: megakernel <<<%u, %u>>> failed (code %d): %s\n", done, h.grid,
                   h.block, code, emu::last_error());
      break;
    }
    records.insert(records.end(), blob + h.control_offset, blob + h.control_offset + h.control_bytes);
    records.insert(records.end(), blob + h.logits_offset, blob + h.logits_offset + h.logits_bytes);
  }
  if (code == emu::kStuck) std::_Exit(3);  // detached threads still run: skip static destructors

  std::FILE* out = std::fopen(argv[2], "wb");
  if (!out) die("cannot create", argv[2]);
  OutHeader oh{};
  std::memcpy(oh.magic, kOutMagic, 8);
  oh.steps_done = done;
  bool ok = std::fwrite(&oh, sizeof oh, 1, out) == 1;
  ok = ok && (records.empty() || std::fwrite(records.data(), records.size(), 1, out) == 1);
  ok = ok && std::fwrite(blob + h.data_offset, h.data_bytes, 1, out) == 1;
  ok = std::fclose(out) == 0 && ok;
  if (!ok) die("cannot write", argv[2]);
  std::free(blob);
  return code == 0 ? 0 : 3;
}

}  // namespace strict_driver

int main(int argc, char** argv) { return strict_driver::main(argc, argv); }

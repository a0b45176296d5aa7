#include "worker_address.h"

#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <map>
#include <set>
#include <string>

namespace kvstash::transport {
namespace {

// UCX 1.13's limits and bits (src/ucp/core/ucp_types.h, src/ucp/wireup/address.{c,h}).
constexpr unsigned kVersionV1 = 0;
constexpr unsigned kVersionV2 = 1;
constexpr uint8_t kHeaderVersionMask = 0x0f;
constexpr unsigned kHeaderFlagsShiftV1 = 4;
constexpr uint8_t kHeaderDebugInfo = 1 << 0;
constexpr uint8_t kHeaderWorkerUuid = 1 << 1;
constexpr uint8_t kHeaderClientId = 1 << 2;
constexpr uint8_t kHeaderAmOnly = 1 << 3;
constexpr uint8_t kKnownHeaderFlags =
    kHeaderDebugInfo | kHeaderWorkerUuid | kHeaderClientId | kHeaderAmOnly;
constexpr uint8_t kNullResource = 0xff;  // an address without devices
constexpr uint8_t kFlagLast = 0x80;
constexpr uint8_t kFlagHasEpAddress = 0x40;  // interface length byte
constexpr uint8_t kFlagNumPaths = 0x40;      // device length byte
constexpr uint8_t kFlagSysDevice = 0x20;     // device length byte
constexpr uint8_t kInterfaceLengthMask = 0xff ^ (kFlagHasEpAddress | kFlagLast);
constexpr uint8_t kDeviceLengthMask = 0xff ^ (kFlagSysDevice | kFlagNumPaths | kFlagLast);
constexpr uint8_t kMdEmptyDevice = 0x80;
constexpr uint8_t kMdMaskV1 = 0xff ^ (0x80 | 0x40 | 0x20);
constexpr uint8_t kMdMaskV2 = 0xff ^ 0x80;
constexpr unsigned kMaxMds = 64;         // bits of ucp_md_map_t
constexpr size_t kMaxResources = 128;    // UCP_MAX_RESOURCES
constexpr unsigned kMaxLanes = 6;        // UCP_MAX_LANES
constexpr unsigned kMaxSysDevices = 64;  // UCP_MAX_SYS_DEVICES
constexpr uint8_t kUnknownSysDevice = 0xff;
constexpr size_t kIfaceAttrBytesV1 = 16;  // ucp_address_packed_iface_attr_t
constexpr size_t kIfaceAttrBytesV2 = 8;   // ucp_address_v2_packed_iface_attr_t

// A cursor over the address that fails instead of reading past its end.
class Reader {
 public:
  explicit Reader(std::span<const std::byte> bytes) : bytes_(bytes) {}

  size_t offset() const { return offset_; }
  size_t left() const { return bytes_.size() - offset_; }

  Status Need(size_t n, std::string_view what) const {
    if (n > left()) {
      return InvalidArgumentError("UCX worker address of {} bytes ends inside {} at offset {}",
                                  bytes_.size(), what, offset_);
    }
    return Status::OK();
  }
  Result<uint8_t> Byte(std::string_view what) {
    KVSTASH_RETURN_IF_ERROR(Need(1, what));
    return static_cast<uint8_t>(bytes_[offset_++]);
  }
  uint8_t Peek() const { return static_cast<uint8_t>(bytes_[offset_]); }
  Result<std::span<const std::byte>> Take(size_t n, std::string_view what) {
    KVSTASH_RETURN_IF_ERROR(Need(n, what));
    auto out = bytes_.subspan(offset_, n);
    offset_ += n;
    return out;
  }
  // UCX's "byte extended" value: in v2 the mask's full value says the value is in the next byte.
  Result<uint8_t> Extended(uint8_t first, uint8_t mask, unsigned version, std::string_view what) {
    const uint8_t value = first & mask;
    if (version != kVersionV1 && value == mask) return Byte(what);
    return value;
  }

 private:
  std::span<const std::byte> bytes_;
  size_t offset_ = 0;
};

Status Bad(const Reader& reader, std::string_view what) {
  return InvalidArgumentError("UCX worker address: {} at offset {}", what, reader.offset());
}

}  // namespace

Result<WorkerAddressShape> ParseWorkerAddress(std::span<const std::byte> address) {
  Reader reader(address);
  WorkerAddressShape shape;
  KVSTASH_ASSIGN_OR_RETURN(const uint8_t header, reader.Byte("its header"));
  shape.version = header & kHeaderVersionMask;
  uint8_t flags = 0;
  if (shape.version == kVersionV1) {
    flags = header >> kHeaderFlagsShiftV1;
  } else if (shape.version == kVersionV2) {
    KVSTASH_ASSIGN_OR_RETURN(flags, reader.Byte("its header flags"));
  } else {
    return InvalidArgumentError("UCX worker address of version {}: this UCX reads versions 0 and 1",
                                shape.version);
  }
  if ((flags & ~kKnownHeaderFlags) != 0) {
    return InvalidArgumentError("UCX worker address with unknown header flags {:#x}", flags);
  }
  // A worker address always has its uuid (ucp_ep_create unpacks it as v1 did, flag or not).
  if (shape.version == kVersionV1 || (flags & kHeaderWorkerUuid) != 0) {
    KVSTASH_ASSIGN_OR_RETURN(auto uuid, reader.Take(sizeof(uint64_t), "its worker uuid"));
    std::memcpy(&shape.worker_uuid, uuid.data(), sizeof(uint64_t));
  }
  if ((flags & kHeaderClientId) != 0) {
    KVSTASH_RETURN_IF_ERROR(reader.Take(sizeof(uint64_t), "its client id").status());
  }
  if ((flags & kHeaderDebugInfo) != 0) {
    KVSTASH_ASSIGN_OR_RETURN(const uint8_t name_bytes, reader.Byte("its worker name"));
    KVSTASH_RETURN_IF_ERROR(reader.Take(name_bytes, "its worker name").status());
  }
  KVSTASH_RETURN_IF_ERROR(reader.Need(1, "its device list"));
  if (reader.Peek() == kNullResource) {
    (void)reader.Byte("its device list");
  } else {
    for (bool last_device = false; !last_device;) {
      KVSTASH_ASSIGN_OR_RETURN(const uint8_t md_byte, reader.Byte("a memory domain"));
      const bool empty_device = (md_byte & kMdEmptyDevice) != 0;
      KVSTASH_ASSIGN_OR_RETURN(
          const uint8_t md_index,
          reader.Extended(md_byte, shape.version == kVersionV1 ? kMdMaskV1 : kMdMaskV2,
                          shape.version, "a memory domain"));
      if (md_index >= kMaxMds) return Bad(reader, fmt::format("memory domain {}", md_index));
      KVSTASH_ASSIGN_OR_RETURN(const uint8_t device_byte, reader.Byte("a device address length"));
      last_device = (device_byte & kFlagLast) != 0;
      KVSTASH_ASSIGN_OR_RETURN(
          const uint8_t device_bytes,
          reader.Extended(device_byte, kDeviceLengthMask, shape.version, "a device address"));
      if ((device_byte & kFlagNumPaths) != 0) {
        KVSTASH_ASSIGN_OR_RETURN(const uint8_t paths, reader.Byte("a device's path count"));
        if (paths == 0) return Bad(reader, "a device of 0 paths");
      }
      if ((device_byte & kFlagSysDevice) != 0) {
        KVSTASH_ASSIGN_OR_RETURN(const uint8_t sys_device, reader.Byte("a system device"));
        if (sys_device >= kMaxSysDevices && sys_device != kUnknownSysDevice) {
          return Bad(reader, fmt::format("system device {}", sys_device));
        }
      }
      KVSTASH_RETURN_IF_ERROR(reader.Take(device_bytes, "a device address").status());
      for (bool last_interface = empty_device; !last_interface;) {
        if (shape.interfaces.size() >= kMaxResources) {
          return Bad(reader, fmt::format("more than {} transport interfaces", kMaxResources));
        }
        AddressInterface& interface = shape.interfaces.emplace_back();
        interface.device_index = static_cast<uint32_t>(shape.devices);
        interface.device_address_bytes = device_bytes;
        KVSTASH_ASSIGN_OR_RETURN(auto checksum,
                                 reader.Take(sizeof(uint16_t), "a transport name checksum"));
        std::memcpy(&interface.transport_checksum, checksum.data(), sizeof(uint16_t));
        const size_t attr_bytes =
            shape.version == kVersionV1 ? kIfaceAttrBytesV1 : kIfaceAttrBytesV2;
        KVSTASH_ASSIGN_OR_RETURN(auto attrs, reader.Take(attr_bytes, "interface attributes"));
        if (shape.version == kVersionV1) {
          float bandwidth = 0;  // after the overhead (both floats)
          std::memcpy(&bandwidth, attrs.data() + sizeof(float), sizeof(float));
          if (!std::isfinite(bandwidth) || bandwidth <= 0) {
            return Bad(reader, fmt::format("an interface of bandwidth {}", bandwidth));
          }
        } else if (static_cast<uint8_t>(attrs[1]) == 0) {  // its fp8 bandwidth
          return Bad(reader, "an interface of bandwidth 0");
        }
        KVSTASH_ASSIGN_OR_RETURN(const uint8_t interface_byte,
                                 reader.Byte("an interface address length"));
        last_interface = (interface_byte & kFlagLast) != 0;
        KVSTASH_ASSIGN_OR_RETURN(const uint8_t interface_bytes,
                                 reader.Extended(interface_byte, kInterfaceLengthMask,
                                                 shape.version, "an interface address"));
        interface.interface_address_bytes = interface_bytes;
        KVSTASH_RETURN_IF_ERROR(reader.Take(interface_bytes, "an interface address").status());
        for (bool more = (interface_byte & kFlagHasEpAddress) != 0; more;) {
          if (interface.endpoint_addresses >= kMaxLanes) {
            return Bad(reader, fmt::format("more than {} endpoint addresses", kMaxLanes));
          }
          KVSTASH_ASSIGN_OR_RETURN(const uint8_t ep_bytes,
                                   reader.Byte("an endpoint address length"));
          KVSTASH_RETURN_IF_ERROR(reader.Take(ep_bytes, "an endpoint address").status());
          KVSTASH_ASSIGN_OR_RETURN(const uint8_t lane, reader.Byte("an endpoint lane"));
          if ((lane & kInterfaceLengthMask) >= kMaxLanes) {
            return Bad(reader, fmt::format("lane {}", lane & kInterfaceLengthMask));
          }
          more = (lane & kFlagLast) == 0;
          ++interface.endpoint_addresses;
        }
      }
      ++shape.devices;
    }
  }
  if (reader.left() != 0) {
    return InvalidArgumentError("UCX worker address of {} bytes has {} byte(s) after its end",
                                address.size(), reader.left());
  }
  return shape;
}

Status CheckPeerWorkerAddress(std::span<const std::byte> peer, std::span<const std::byte> own) {
  KVSTASH_ASSIGN_OR_RETURN(const WorkerAddressShape theirs, ParseWorkerAddress(peer));
  KVSTASH_ASSIGN_OR_RETURN(const WorkerAddressShape ours, ParseWorkerAddress(own));
  if (theirs.worker_uuid == ours.worker_uuid) {
    return InvalidArgumentError("the UCX worker address is this node's own");
  }
  std::map<uint16_t, std::set<size_t>> interface_bytes;  // ours, by transport
  for (const AddressInterface& i : ours.interfaces) {
    interface_bytes[i.transport_checksum].insert(i.interface_address_bytes);
  }
  bool shared = false;
  for (const AddressInterface& i : theirs.interfaces) {
    if (i.endpoint_addresses != 0) {
      return InvalidArgumentError(
          "the UCX worker address carries endpoint addresses (a worker address has none)");
    }
    auto known = interface_bytes.find(i.transport_checksum);
    if (known == interface_bytes.end()) continue;  // a transport this node lacks: UCX skips it
    if (!known->second.contains(i.interface_address_bytes)) {
      return FailedPreconditionError(
          "the client's UCX transport {:#06x} has {}-byte interface addresses where this node's "
          "has {}: another UCX version or build",
          i.transport_checksum, i.interface_address_bytes, *known->second.begin());
    }
    shared = true;
  }
  if (!shared) {
    return FailedPreconditionError(
        "the client's UCX offers none of this node's transports ({} interface(s) offered): set "
        "UCX_TLS on both to transports they share",
        theirs.interfaces.size());
  }
  return Status::OK();
}

}  // namespace kvstash::transport

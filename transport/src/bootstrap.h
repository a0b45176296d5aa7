#pragma once

// The bootstrap socket's framing: each message is a 4-byte little-endian length and that many
// bytes of protobuf (wire.Hello, wire.HelloReply). Private to transport/ (the UCX and the stream
// transports both say hello this way).

#include <google/protobuf/message_lite.h>

#include <asio.hpp>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>

#include "kvstash/common/status.h"

namespace kvstash::transport {

inline constexpr size_t kMaxBootstrapMessageBytes = 64 * 1024;

inline void AsyncWriteMessage(asio::ip::tcp::socket& socket,
                              const google::protobuf::MessageLite& message,
                              std::function<void(Status)> done) {
  auto buffer = std::make_shared<std::string>(4, '\0');
  const uint32_t length = static_cast<uint32_t>(message.ByteSizeLong());
  std::memcpy(buffer->data(), &length, 4);
  message.AppendToString(buffer.get());
  asio::async_write(
      socket, asio::buffer(*buffer),
      [buffer, done = std::move(done)](const asio::error_code& error, size_t) {
        done(error ? UnavailableError("bootstrap write: {}", error.message()) : Status::OK());
      });
}

inline void AsyncReadMessage(asio::ip::tcp::socket& socket,
                             std::function<void(Status, std::string)> done) {
  auto length = std::make_shared<uint32_t>(0);
  asio::async_read(
      socket, asio::buffer(length.get(), 4),
      [&socket, length, done = std::move(done)](const asio::error_code& error, size_t) mutable {
        if (error) {
          done(UnavailableError("bootstrap read: {}", error.message()), {});
          return;
        }
        if (*length > kMaxBootstrapMessageBytes) {
          done(InvalidArgumentError("bootstrap message of {} bytes exceeds the limit of {}",
                                    *length, kMaxBootstrapMessageBytes),
               {});
          return;
        }
        auto body = std::make_shared<std::string>(*length, '\0');
        asio::async_read(
            socket, asio::buffer(*body),
            [body, done = std::move(done)](const asio::error_code& body_error, size_t) {
              if (body_error) {
                done(UnavailableError("bootstrap read: {}", body_error.message()), {});
              } else {
                done(Status::OK(), std::move(*body));
              }
            });
      });
}

}  // namespace kvstash::transport

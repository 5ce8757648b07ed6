#pragma once
#include <cstddef>
#include <cstdint>
#include <utility>
namespace util {
typedef std::pair<uint64_t, uint64_t> uint128_t;
inline uint64_t Uint128Low64(const uint128_t& x) { return x.first; }
inline uint64_t Uint128High64(const uint128_t& x) { return x.second; }
uint64_t Fingerprint64(const char* s, size_t len);
uint32_t Fingerprint32(const char* s, size_t len);
uint128_t Fingerprint128(const char* s, size_t len);
}

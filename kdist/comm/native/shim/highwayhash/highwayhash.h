#pragma once
namespace highwayhash {
template <unsigned kTarget> class HighwayHashCatT { unsigned long long opaque_[32]; };
}

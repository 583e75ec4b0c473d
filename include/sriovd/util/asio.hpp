#pragma once
// The one way into Boost.Asio for this project. Boost 1.74's Asio uses
// std::exchange in asio/awaitable.hpp without including <utility>, which
// breaks under -std=c++20; including it first here fixes that for everyone.
#include <utility>

#include <boost/asio.hpp>

namespace sriovd {
namespace asio = boost::asio;
}

#include "sriovd/k8s/api_client.hpp"

#include <arpa/inet.h>
#include <openssl/evp.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <yaml-cpp/yaml.h>

#include "sriovd/version.hpp"

namespace sriovd::k8s {

namespace net = boost::asio;
namespace ssl = boost::asio::ssl;
namespace beast = boost::beast;
namespace http = boost::beast::http;
using tcp = boost::asio::ip::tcp;
using json = nlohmann::json;

namespace {

std::string read_file(const std::string& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(what + ": cannot read " + path);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string base64_decode(const std::string& in, const std::string& what) {
  std::string out(in.size() / 4 * 3 + 3, '\0');
  EVP_ENCODE_CTX* ctx = EVP_ENCODE_CTX_new();
  EVP_DecodeInit(ctx);
  int n = 0;
  int tail = 0;
  const int rc = EVP_DecodeUpdate(ctx, reinterpret_cast<unsigned char*>(out.data()), &n,
                                  reinterpret_cast<const unsigned char*>(in.data()), static_cast<int>(in.size()));
  const int final_rc = rc < 0 ? -1 : EVP_DecodeFinal(ctx, reinterpret_cast<unsigned char*>(out.data()) + n, &tail);
  EVP_ENCODE_CTX_free(ctx);
  if (rc < 0 || final_rc < 0) throw std::runtime_error(what + ": not base64");
  out.resize(static_cast<size_t>(n) + static_cast<size_t>(tail));
  return out;
}

bool is_ip(const std::string& host) {
  unsigned char buf[sizeof(in6_addr)];
  return ::inet_pton(AF_INET, host.c_str(), buf) == 1 || ::inet_pton(AF_INET6, host.c_str(), buf) == 1;
}

// "https://host[:port][/]": host and port; IPv6 in brackets.
void parse_server(const std::string& url, ApiConfig& c, const std::string& what) {
  const std::string scheme = "https://";
  if (url.rfind(scheme, 0) != 0)
    throw std::runtime_error(what + ": server '" + url + "' is not https:// (the API server is only reached over TLS)");
  std::string rest = url.substr(scheme.size());
  if (!rest.empty() && rest.back() == '/') rest.pop_back();
  if (rest.find('/') != std::string::npos)
    throw std::runtime_error(what + ": server '" + url + "' has a path (not supported)");
  if (!rest.empty() && rest.front() == '[') {
    const auto close = rest.find(']');
    if (close == std::string::npos) throw std::runtime_error(what + ": server '" + url + "': unclosed '['");
    c.host = rest.substr(1, close - 1);
    rest = rest.substr(close + 1);
    if (!rest.empty()) {
      if (rest.front() != ':') throw std::runtime_error(what + ": server '" + url + "': junk after the address");
      c.port = rest.substr(1);
    }
  } else {
    const auto colon = rest.find(':');
    c.host = rest.substr(0, colon);
    if (colon != std::string::npos) c.port = rest.substr(colon + 1);
  }
  if (c.host.empty()) throw std::runtime_error(what + ": server '" + url + "' has no host");
  if (c.port.empty() || c.port.find_first_not_of("0123456789") != std::string::npos || c.port.size() > 5 ||
      std::stoi(c.port) == 0 || std::stoi(c.port) > 65535)
    throw std::runtime_error(what + ": server '" + url + "': port '" + c.port + "'");
}

// A named entry of a kubeconfig list (clusters, contexts, users).
YAML::Node named(const YAML::Node& root, const char* list, const std::string& name, const std::string& what) {
  const YAML::Node entries = root[list];
  if (entries && entries.IsSequence())
    for (const YAML::Node& e : entries)
      if (e["name"] && e["name"].as<std::string>() == name) return e;
  throw std::runtime_error(what + ": no " + std::string(list).substr(0, std::string(list).size() - 1) + " '" + name +
                           "' in " + list);
}

// `key-data` (base64) or `key` (a file, relative to the kubeconfig's
// directory); "" when neither is there.
std::string data_or_file(const YAML::Node& n, const std::string& key, const std::filesystem::path& dir,
                         const std::string& what) {
  if (n[key + "-data"]) return base64_decode(n[key + "-data"].as<std::string>(), what + ": " + key + "-data");
  if (n[key]) {
    std::filesystem::path p = n[key].as<std::string>();
    if (p.is_relative()) p = dir / p;
    return read_file(p.string(), what + ": " + key);
  }
  return "";
}

}  // namespace

ApiConfig load_kubeconfig(const std::string& path) {
  const std::string what = "kubeconfig " + path;
  YAML::Node root;
  try {
    root = YAML::Load(read_file(path, what));
  } catch (const YAML::Exception& e) {
    throw std::runtime_error(what + ": " + e.what());
  }
  ApiConfig c;
  try {
    if (!root.IsMap() || !root["current-context"] || root["current-context"].as<std::string>().empty())
      throw std::runtime_error(what + ": no current-context");
    const std::string context_name = root["current-context"].as<std::string>();
    c.source = what + ", context " + context_name;
    const YAML::Node context = named(root, "contexts", context_name, what)["context"];
    if (!context || !context["cluster"] || !context["user"])
      throw std::runtime_error(c.source + ": the context names no cluster or no user");
    const std::filesystem::path dir = std::filesystem::absolute(path).parent_path();
    const YAML::Node cluster = named(root, "clusters", context["cluster"].as<std::string>(), what)["cluster"];
    if (!cluster || !cluster["server"]) throw std::runtime_error(c.source + ": the cluster has no server");
    if (cluster["insecure-skip-tls-verify"] && cluster["insecure-skip-tls-verify"].as<bool>())
      throw std::runtime_error(
          c.source + ": insecure-skip-tls-verify is refused (the API server's certificate is always verified)");
    parse_server(cluster["server"].as<std::string>(), c, c.source);
    c.ca_pem = data_or_file(cluster, "certificate-authority", dir, c.source);
    const YAML::Node user = named(root, "users", context["user"].as<std::string>(), what)["user"];
    if (!user) throw std::runtime_error(c.source + ": the user has no credentials");
    if (user["token"]) c.token = user["token"].as<std::string>();
    if (user["tokenFile"]) {
      std::filesystem::path p = user["tokenFile"].as<std::string>();
      c.token_file = (p.is_relative() ? dir / p : p).string();
      (void)read_file(c.token_file, c.source + ": tokenFile");
    }
    c.client_cert_pem = data_or_file(user, "client-certificate", dir, c.source);
    c.client_key_pem = data_or_file(user, "client-key", dir, c.source);
    if (c.client_cert_pem.empty() != c.client_key_pem.empty())
      throw std::runtime_error(c.source + ": a client certificate needs its key, and a key its certificate");
    if (user["exec"] || user["auth-provider"])
      throw std::runtime_error(c.source + ": exec and auth-provider credentials are not supported (use a token)");
    if (c.token.empty() && c.token_file.empty() && c.client_cert_pem.empty())
      throw std::runtime_error(c.source + ": the user has no token and no client certificate");
  } catch (const YAML::Exception& e) {
    throw std::runtime_error(what + ": " + e.what());
  }
  return c;
}

ApiConfig in_cluster(const std::string& account_dir) {
  const char* host = ::getenv("KUBERNETES_SERVICE_HOST");
  const char* port = ::getenv("KUBERNETES_SERVICE_PORT");
  if (!host || !*host || !port || !*port)
    throw std::runtime_error("in-cluster: KUBERNETES_SERVICE_HOST/PORT are not set (not in a pod? set a kubeconfig)");
  ApiConfig c;
  c.source = "the service account in " + account_dir;
  const std::string h(host);
  parse_server("https://" + (h.find(':') != std::string::npos ? "[" + h + "]" : h) + ":" + port, c, c.source);
  c.token_file = account_dir + "/token";
  (void)read_file(c.token_file, c.source);
  c.ca_pem = read_file(account_dir + "/ca.crt", c.source);
  return c;
}

struct ApiClient::Tls {
  ssl::context ctx{ssl::context::tls_client};
};

ApiClient::ApiClient(ApiConfig config) : config_(std::move(config)), tls_(std::make_unique<Tls>()) {
  try {
    tls_->ctx.set_verify_mode(ssl::verify_peer);
    tls_->ctx.set_options(ssl::context::no_sslv2 | ssl::context::no_sslv3 | ssl::context::no_tlsv1 |
                          ssl::context::no_tlsv1_1);
    if (config_.ca_pem.empty())
      tls_->ctx.set_default_verify_paths();
    else
      tls_->ctx.add_certificate_authority(net::buffer(config_.ca_pem));
    if (!config_.client_cert_pem.empty()) {
      tls_->ctx.use_certificate_chain(net::buffer(config_.client_cert_pem));
      tls_->ctx.use_private_key(net::buffer(config_.client_key_pem), ssl::context::pem);
    }
  } catch (const boost::system::system_error& e) {
    throw std::runtime_error(config_.source + ": its CA or client certificate: " + e.what());
  }
}

ApiClient::~ApiClient() = default;

json ApiClient::request(const char* method, const std::string& path, const std::string& body) {
  const std::string what = std::string(method) + " https://" + config_.host + ":" + config_.port + path;
  const auto deadline = std::chrono::steady_clock::now() + config_.timeout;
  net::io_context ioc;
  beast::ssl_stream<beast::tcp_stream> stream(ioc, tls_->ctx);
  beast::get_lowest_layer(stream).expires_at(deadline);
  // Runs one asynchronous step to its end or to the deadline. A step that
  // did not end leaves its handler unrun: the io_context goes with it.
  const auto step = [&](const char* stage, auto start) {
    boost::system::error_code ec;
    bool done = false;
    start([&](boost::system::error_code e, auto&&...) {
      ec = e;
      done = true;
    });
    ioc.restart();
    ioc.run_until(deadline);
    if (!done || ec == beast::error::timeout)
      throw ApiUnreachable(what + ": " + stage + ": no answer within " + std::to_string(config_.timeout.count()) +
                           " ms");
    if (ec) throw ApiUnreachable(what + ": " + stage + ": " + ec.message());
  };
  tcp::resolver resolver(ioc);
  tcp::resolver::results_type endpoints;
  step("resolving the host", [&](auto done) {
    resolver.async_resolve(config_.host, config_.port,
                           [&endpoints, done](boost::system::error_code e, tcp::resolver::results_type r) mutable {
                             endpoints = std::move(r);
                             done(e);
                           });
  });
  step("connecting", [&](auto done) { beast::get_lowest_layer(stream).async_connect(endpoints, done); });
  // The certificate must name the host we asked for (a name or an IP).
  SSL* s = stream.native_handle();
  X509_VERIFY_PARAM* param = SSL_get0_param(s);
  if (is_ip(config_.host)) {
    X509_VERIFY_PARAM_set1_ip_asc(param, config_.host.c_str());
  } else {
    // SNI (SSL_set_tlsext_host_name, without its C cast).
    SSL_ctrl(s, SSL_CTRL_SET_TLSEXT_HOSTNAME, TLSEXT_NAMETYPE_host_name, const_cast<char*>(config_.host.c_str()));
    X509_VERIFY_PARAM_set1_host(param, config_.host.c_str(), 0);
  }
  step("TLS handshake", [&](auto done) { stream.async_handshake(ssl::stream_base::client, done); });

  http::request<http::string_body> req{http::string_to_verb(method), path, 11};
  req.set(http::field::host, config_.host);
  req.set(http::field::user_agent, std::string("sriovd/") + kVersion);
  req.set(http::field::accept, "application/json");
  std::string token = config_.token;
  if (!config_.token_file.empty()) {
    token = read_file(config_.token_file, config_.source + ": token");
    while (!token.empty() && (token.back() == '\n' || token.back() == '\r' || token.back() == ' ')) token.pop_back();
  }
  if (!token.empty()) req.set(http::field::authorization, "Bearer " + token);
  if (!body.empty()) {
    req.set(http::field::content_type, "application/json");
    req.body() = body;
  }
  req.prepare_payload();
  step("sending", [&](auto done) { http::async_write(stream, req, done); });
  beast::flat_buffer buffer;
  http::response_parser<http::string_body> parser;
  parser.body_limit(64U << 20);  // a list of every claim of a big cluster stays far below
  step("reading the answer", [&](auto done) { http::async_read(stream, buffer, parser, done); });
  boost::system::error_code ignored;
  beast::get_lowest_layer(stream).socket().close(ignored);  // no TLS close_notify wait: the answer is whole

  const auto& res = parser.get();
  const int status = static_cast<int>(res.result_int());
  json reply;
  try {
    reply = res.body().empty() ? json::object() : json::parse(res.body());
  } catch (const json::exception&) {
    if (status >= 200 && status < 300) throw ApiUnreachable(what + ": the answer is not JSON");
  }
  if (status >= 200 && status < 300) return reply;
  std::string message = reply.is_object() ? reply.value("message", std::string()) : std::string();
  if (message.empty()) message = std::string(res.reason());
  throw ApiError(status, what + ": " + std::to_string(status) + " " + message);
}

json ApiClient::get(const std::string& path) { return request("GET", path, ""); }
json ApiClient::create(const std::string& path, const json& body) { return request("POST", path, body.dump()); }
json ApiClient::replace(const std::string& path, const json& body) { return request("PUT", path, body.dump()); }

void ApiClient::remove(const std::string& path, const std::string& resource_version) {
  std::string body;
  if (!resource_version.empty())
    body =
        json{
            {"kind", "DeleteOptions"}, {"apiVersion", "v1"}, {"preconditions", {{"resourceVersion", resource_version}}}}
            .dump();
  (void)request("DELETE", path, body);
}

std::optional<json> ApiClient::find(const std::string& path) {
  try {
    return get(path);
  } catch (const ApiError& e) {
    if (e.status() == 404) return std::nullopt;
    throw;
  }
}

}  // namespace sriovd::k8s

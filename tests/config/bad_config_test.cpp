// Bad configurations, one rule each: every case asserts the exact position
// and the exact text of the first diagnostic, so a message that stops naming
// its input fails here.
#include <gtest/gtest.h>

#include "sriovd/config/loader.hpp"
#include "bad_configs.hpp"

namespace sriovd::config {
namespace {

using bad_configs::BadCase;
using bad_configs::kCases;

class BadConfig : public ::testing::TestWithParam<BadCase> {};

TEST_P(BadConfig, FirstDiagnosticNamesLineColumnAndProblem) {
  const BadCase& c = GetParam();
  try {
    parse(c.text, "bad.yaml");
    FAIL() << "accepted:\n" << c.text;
  } catch (const ConfigError& e) {
    ASSERT_FALSE(e.diagnostics().empty());
    const Diagnostic& d = e.diagnostics().front();
    EXPECT_EQ(d.file, "bad.yaml");
    EXPECT_EQ(d.message, c.message) << "all diagnostics:\n" << e.what();
    EXPECT_EQ(d.line, c.line) << d.to_string();
    EXPECT_EQ(d.column, c.column) << d.to_string();
  }
}

INSTANTIATE_TEST_SUITE_P(Table, BadConfig, ::testing::ValuesIn(kCases),
                         [](const auto& param_info) { return std::string(param_info.param.name); });

TEST(BadConfigTable, HasAtLeastFortyCases) { EXPECT_GE(std::size(kCases), 40U); }

}  // namespace
}  // namespace sriovd::config

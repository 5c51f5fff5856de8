// The plugin's test, with the testing kit installed with Fulgur: the plugin is created from the
// library just built, through the same door the Trainer uses, then driven by a FakeTrainer and put
// through the conformance checks every callback should pass.
#include <fulgur/testing/plugin_kit.h>

#include <cmath>
#include <cstdio>
#include <limits>

namespace kit = fulgur::testing;

int main() {
  const std::vector<std::string> here{DIVERGENCE_GUARD_DIR};
  auto make = [&] {
    return kit::create_plugin<fulgur::Callback>(fulgur::PluginKind::callback, "divergence_guard",
                                                {{"monitor", std::string("val/loss")}, {"limit", 10.0}}, here);
  };
  int failures = 0;
  auto expect = [&](bool ok, const char* what) {
    std::printf("%s: %s\n", ok ? "ok" : "FAIL", what);
    failures += ok ? 0 : 1;
  };

  for (double value : {5.0, 12.0, std::numeric_limits<double>::quiet_NaN()}) {
    auto guard = make();
    kit::FakeTrainer trainer;
    trainer.metrics = {{"val/loss", value}};
    guard->on_train_epoch_end(trainer);
    const bool should_stop = !(value <= 10.0);
    expect(trainer.should_stop() == should_stop, std::isnan(value) ? "NaN stops"
                                                 : should_stop     ? "above the limit stops"
                                                                   : "below the limit goes on");
  }
  try {
    kit::check_callback_conformance(make());
    expect(true, "conformance");
  } catch (const std::exception& e) {
    std::printf("%s\n", e.what());
    expect(false, "conformance");
  }
  return failures == 0 ? 0 : 1;
}

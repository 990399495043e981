#include "app/train/graph_capture.h"

namespace faceshard {

void capture_or_undo(CaptureSteps& steps, const std::function<void()>& work) {
  try {
    steps.begin();
    work();
    steps.end();
  } catch (...) {
    // Best effort: the error that broke the capture is the one reported, not a later one.
    try {
      steps.abandon();
    } catch (...) {
    }
    for (const CaptureSteps::Pool pool : {CaptureSteps::Pool::Device, CaptureSteps::Pool::Host}) {
      try {
        if (steps.stop_recording(pool)) steps.release(pool);
      } catch (...) {
      }
    }
    throw;
  }
}

}  // namespace faceshard

"""`python -m rank_fault ...`: oscar's command line, except that calibration process 1 kills itself (SIGKILL)
when its second forward pass reaches the first attention layer: a rank that dies in the middle of a run."""

import os
import signal

from oscar_core.calibrate.statistics import AttentionStatistics

if os.environ.get("RANK") == "1":
    observe = AttentionStatistics.observe
    forwards = []

    def dying(self, layer, *args):
        if layer == 0:
            forwards.append(layer)
            if len(forwards) == 2:
                os.kill(os.getpid(), signal.SIGKILL)
        return observe(self, layer, *args)

    AttentionStatistics.observe = dying

from oscar_cli.app import main  # noqa: E402

if __name__ == "__main__":
    main()

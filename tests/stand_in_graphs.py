"""CUDA graphs replaced, on the CPU, by a replay of StaticDecode's step with the window it was
captured with, as a graph would replay it: the loop's graph bookkeeping, tested without a GPU."""

from __future__ import annotations


def stand_in_graphs(monkeypatch) -> list[int]:
    """Makes StaticDecode capture stand-in graphs; returns the list the captured windows go to."""
    from fusedalign.generation import static

    captured = []

    class Graph:
        def __init__(self, step, slots):
            self.step, self.slots = step, slots

        def replay(self):
            self.step(self.slots)

    def capture(step, device, slots):
        step(slots)  # the warm-up is a real step
        captured.append(slots)
        return Graph(step, slots)

    monkeypatch.setattr(static, "graphs_possible", lambda device: True)
    monkeypatch.setattr(static, "capture_step", capture)
    return captured

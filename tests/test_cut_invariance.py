"""With per-client server copies at the devices' rate and clipping off, the cut changes the cost, not the learning.

Each device's own server copy, stepped at the devices' rate from the round's weights and averaged by data weight
like the devices' blocks, makes a fixed split run the same SGD on the same batches as any other split (and as
FedAvg): the split only moves where each block's step is computed (docs/method.md, "Where the split cannot
matter"). So static at p_1 and static at p_K must give the same losses, up to float rounding. The tolerance of
the second round is looser than the first's: a step through BatchNorm on digits turns a rounding difference
of 1e-7 in the weights into ~1e-4 in the next step's (weights perturbed by 1e-7 of themselves give ~7e-5
after one step). Measured here: p_1 against p_K 5e-7 in round 1 and 2.6e-4 in round 2; a server copy at 1.5x
the devices' rate moves them by 4.8e-3 and 7.3e-3, one shared server copy by 9.3e-3 and 1.6e-2.
"""

from __future__ import annotations

from _runs import tiny_config

from fedsga_edge.simulation import Simulation


def _losses(digits, split: int, **kw) -> list[float]:
    cfg = tiny_config("static", split=split, rounds=2, clients=2, max_batches=2,
                      **({"server_copies": "per_client", "clip_activations": 0.0, "clip_updates": 0.0} | kw))
    cfg.train.lr = 0.01  # server_lr None: the server's copies train at the devices' rate
    return [r["train_loss"] for r in Simulation(cfg, digits).rounds()]


def test_static_at_p1_and_at_pK_train_the_same_with_per_client_copies(digits) -> None:
    shallow = _losses(digits, 1)
    deep = _losses(digits, 3)  # p_K of resnet18_cifar
    assert abs(shallow[0] - deep[0]) < 1e-5  # two steps per device, each at its own cut
    assert abs(shallow[1] - deep[1]) < 2e-3  # after averaging the copies and the devices' blocks

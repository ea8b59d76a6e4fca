"""Which errors mean "a trainer rank is gone" (restart the group) and which fail the run.

A collective's error that is taken for a lost peer makes rank 0 exit instead of failing the
run; anything else taken for one would restart the group over a bad model or spec until
torchrun gives up, so the classification must be narrow both ways.
"""

from __future__ import annotations

import pytest

from trainer_svc.errors import GroupLost, group_lost
from trainer_svc.torchrun import torchrun_args

# Verbatim from torch 2.13's gloo when the peer rank was SIGKILLed mid all-reduce.
GLOO_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
               "Connection closed by peer [127.0.0.1]:50574. This is typically caused by a "
               "remote worker crashing. Check the logs of the remote worker before reporting "
               "an error. GLHF!")
GLOO_RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read "
              "error [127.0.0.1]:19377: Connection reset by peer.")


@pytest.mark.parametrize("message", [GLOO_CLOSED, GLOO_RESET])
def test_gloo_peer_errors_are_a_lost_group(message: str) -> None:
    lost = group_lost(RuntimeError(message))
    assert isinstance(lost, GroupLost)
    assert "Connection" in str(lost)  # the cause stays readable in the one log line


def test_a_wrapped_peer_error_is_found_through_its_cause() -> None:
    try:
        try:
            raise RuntimeError(GLOO_CLOSED)
        except RuntimeError as inner:
            raise ValueError("add_round failed") from inner
    except ValueError as outer:
        assert isinstance(group_lost(outer), GroupLost)


def test_a_dist_error_subclass_is_a_lost_group() -> None:
    class DistError(RuntimeError):  # torch.distributed.DistError's name, as nccl raises it
        pass

    class DistBackendError(DistError):
        pass

    assert isinstance(group_lost(DistBackendError("NCCL error: unhandled system error")),
                      GroupLost)


@pytest.mark.parametrize("exc", [
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x8)"),
    ValueError("model 'tiny' knows only the arith-seq task's 14 tokens"),
    OSError("No space left on device"),
    KeyError("model.embed_tokens.weight"),
])
def test_ordinary_errors_are_not(exc: Exception) -> None:
    assert group_lost(exc) is None


def test_a_looping_context_chain_ends() -> None:
    a, b = ValueError("a"), ValueError("b")
    a.__context__, b.__context__ = b, a
    assert group_lost(a) is None


def test_an_existing_group_lost_is_returned_as_is() -> None:
    lost = GroupLost("rank 1 is gone")
    assert group_lost(lost) is lost


def test_torchrun_args_name_the_group_and_its_restarts() -> None:
    args = torchrun_args(2, 5)
    assert args[args.index("--nproc-per-node") + 1] == "2"
    assert args[args.index("--max-restarts") + 1] == "5"
    assert args[-2:] == ["-m", "trainer_svc"]
    with pytest.raises(ValueError, match="ranks"):
        torchrun_args(0)
    with pytest.raises(ValueError, match="restarts"):
        torchrun_args(2, -1)

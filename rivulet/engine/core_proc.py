"""The EngineCore process: receives requests over ZeroMQ, steps the engine, sends outputs back.

It blocks on its input socket while idle and drains it between steps while busy, so requests
arriving during a step join the next one. It exits when told to, when its parent dies (checked
every step and every 0.5 s while idle; a send to a front end that is gone gives up after 1 s), and,
with an error, when a worker rank has died (checked before every step and every 0.5 s while idle).
While it has work it sends a message at least every second (a step's outputs, or an empty one), so the
front end's watchdog can tell a slow engine from a stuck one.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback

import zmq

from rivulet.config import EngineConfig, RivuletError
from rivulet.core.request import RequestStatus
from rivulet.core.outputs import EngineCoreOutput
from rivulet.engine.core import EngineCore
from rivulet.engine.outputs import StepOutput
from rivulet.engine.messages import (Abort, AddRequest, Failed, GetStats, Outputs, Ready, Shutdown, Stats, Stop,
                                     encode, to_core_decoder)
from rivulet.models.loader import resolve_model

logger = logging.getLogger(__name__)
HEARTBEAT_S = 1.0  # the longest silence while there is work


class _Orphaned(Exception):
    """The process that started this engine has exited."""


def main() -> None:
    """`python -m rivulet.engine.core_proc INPUT_ADDR OUTPUT_ADDR` with the EngineConfig as JSON on stdin."""
    logging.basicConfig(level=logging.INFO, format="rivulet engine: %(message)s")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    run_engine_core(EngineConfig.from_json(sys.stdin.read()), sys.argv[1], sys.argv[2])


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str) -> None:
    """The engine process's loop."""
    if config.parallel.cpus:  # a data-parallel replica: its share of the cores (its workers inherit it)
        os.sched_setaffinity(0, config.parallel.cpus)
    parent = os.getppid()
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(input_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.SNDTIMEO, 1000)  # a send blocks while no front end is connected: look up now and then
    outbox.connect(output_addr)

    def orphaned() -> bool:
        return os.getppid() != parent

    def send(msg: object) -> None:
        data = encode(msg)
        while True:
            try:
                outbox.send(data)
                return
            except zmq.Again:
                if orphaned():
                    raise _Orphaned from None
    try:
        core = EngineCore(config, resolve_model(config.model.model))
    except Exception as e:  # report the load failure as a message, not a silent death
        try:
            send(Failed(str(e) if isinstance(e, ValueError) else traceback.format_exc()))
        except _Orphaned:
            pass
        outbox.close(linger=2000)
        return
    try:
        send(Ready(core.model_info()))
        last_sent = time.monotonic()
        while True:
            timeout = 0 if core.has_unfinished_requests() else 500
            while inbox.poll(timeout):
                msg = to_core_decoder.decode(inbox.recv())
                if isinstance(msg, AddRequest):
                    try:
                        core.add_request(msg.to_request())
                    except ValueError as e:  # the front end validates first; this is a last guard
                        error = EngineCoreOutput(msg.request_id, [], "error", error=str(e))
                        send(Outputs([StepOutput(error)]))
                elif isinstance(msg, Abort):
                    core.abort_requests(msg.request_ids)
                elif isinstance(msg, Stop):
                    core.finish_requests(msg.request_ids, RequestStatus.FINISHED_STOPPED)
                elif isinstance(msg, GetStats):
                    send(Stats(core.get_stats()))
                elif isinstance(msg, Shutdown):
                    core.shutdown()
                    return
                timeout = 0
            if orphaned():
                raise _Orphaned
            if core.has_unfinished_requests():
                outs = core.step()
                if outs or time.monotonic() - last_sent > HEARTBEAT_S:  # steps without outputs still show progress
                    send(Outputs(outs))
                    last_sent = time.monotonic()
            else:
                core.check_health()  # a dead worker rank ends the engine now, not at the next request
    except _Orphaned:
        logger.info("the front end is gone: exiting")
        core.shutdown()  # worker ranks too
    except RivuletError as e:  # a worker rank died: the front end sees this process exit
        logger.error("%s", e)
        core.shutdown()
        raise SystemExit(1) from None
    finally:
        inbox.close(linger=0)
        outbox.close(linger=1000)
        ctx.term()


if __name__ == "__main__":
    main()

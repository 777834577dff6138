"""The EngineCore process: receives requests over ZeroMQ, steps the engine, sends outputs back.

It blocks on its input socket while idle and drains it between steps while busy, so requests
arriving during a step join the next one. It exits when told to, or when its parent dies.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback

import zmq

from rivulet.config import EngineConfig
from rivulet.core.request import RequestStatus
from rivulet.core.outputs import EngineCoreOutput
from rivulet.engine.core import EngineCore
from rivulet.engine.outputs import StepOutput
from rivulet.engine.messages import (Abort, AddRequest, Failed, GetStats, Outputs, Ready, Shutdown, Stats, Stop,
                                     encode, to_core_decoder)
from rivulet.models.loader import resolve_model

logger = logging.getLogger(__name__)


def main() -> None:
    """`python -m rivulet.engine.core_proc INPUT_ADDR OUTPUT_ADDR` with the EngineConfig as JSON on stdin."""
    logging.basicConfig(level=logging.INFO, format="rivulet engine: %(message)s")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    run_engine_core(EngineConfig.from_json(sys.stdin.read()), sys.argv[1], sys.argv[2])


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str) -> None:
    """The engine process's loop."""
    parent = os.getppid()
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(input_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(output_addr)
    try:
        core = EngineCore(config, resolve_model(config.model.model))
    except Exception as e:  # report the load failure as a message, not a silent death
        outbox.send(encode(Failed(str(e) if isinstance(e, ValueError) else traceback.format_exc())))
        outbox.close(linger=2000)
        return
    outbox.send(encode(Ready(core.model_info())))
    try:
        while True:
            timeout = 0 if core.has_unfinished_requests() else 500
            while inbox.poll(timeout):
                msg = to_core_decoder.decode(inbox.recv())
                if isinstance(msg, AddRequest):
                    try:
                        core.add_request(msg.to_request())
                    except ValueError as e:  # the front end validates first; this is a last guard
                        error = EngineCoreOutput(msg.request_id, [], "error", error=str(e))
                        outbox.send(encode(Outputs([StepOutput(error)])))
                elif isinstance(msg, Abort):
                    core.abort_requests(msg.request_ids)
                elif isinstance(msg, Stop):
                    core.finish_requests(msg.request_ids, RequestStatus.FINISHED_STOPPED)
                elif isinstance(msg, GetStats):
                    outbox.send(encode(Stats(core.get_stats())))
                elif isinstance(msg, Shutdown):
                    core.shutdown()
                    return
                timeout = 0
            if core.has_unfinished_requests():
                outs = core.step()
                if outs:
                    outbox.send(encode(Outputs(outs)))
            elif os.getppid() != parent:
                return  # orphaned: the front end is gone
    finally:
        inbox.close(linger=0)
        outbox.close(linger=1000)
        ctx.term()


if __name__ == "__main__":
    main()

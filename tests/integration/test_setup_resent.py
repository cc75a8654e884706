"""A job setup sent again, as a client does when the coordinator that took it died before
its reply arrived and the call goes on to the next leader: it gets what the first one set
up (a new job stays a new job), not JobInUse; another setup is still refused."""

from __future__ import annotations

import grpc
import pytest

from elasticpipe.coordinator.server import CoordinatorServer
from elasticpipe.errors import JobInUse
from elasticpipe.stage_server.server import StageServer
from elasticpipe.training.job import JobConfig
from elasticpipe.transport import rpc
from elasticpipe.v1 import coordinator_pb2, coordinator_pb2_grpc

pytestmark = pytest.mark.timeout(120)


def test_a_resent_setup_gets_its_job_and_another_is_refused(
    coordinator_server: CoordinatorServer, stage_servers: list[StageServer]
) -> None:
    spec = JobConfig(model="mlp", model_kwargs={"sizes": [8, 16, 16, 4]}, micro_batches=2)

    def setup(request_id: str) -> coordinator_pb2.SetupJobResponse:
        request = coordinator_pb2.SetupJobRequest(
            job=spec.to_proto(),
            num_stages=2,
            wait_s=10,
            lease_s=30,
            client_name="trainer:1",
            request_id=request_id,
        )
        with grpc.insecure_channel(coordinator_server.address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            return rpc.call(coordinator_server.address, stub.SetupJob, request, timeout=60)

    first = setup("r-1")
    assert not first.resumed and first.committed_step == 0
    again = setup("r-1")  # the first reply was lost: the same request, once more
    assert again.partition.job_id == first.partition.job_id
    assert not again.resumed  # still a new job: the client applies its init_state
    assert again.client > first.client  # the lost reply's generation is fenced
    with pytest.raises(JobInUse, match="trainer:1"):
        setup("r-2")  # another setup while the job is held
    with pytest.raises(JobInUse):
        setup("")  # one that names no request

"""The sync and asyncio clients agree (they share one sans-I/O core,
logprob_client/_internal/base.py, and only perform its I/O differently):

- ParityTest: one table of cases (inputs, every score option, client
  settings: limits, chunking, shared memory, CUDA IPC, retries, TLS/token
  arguments; and refusals) run through ``LogprobClient`` and
  ``aio.LogprobClient`` against the same live CPU server, asserting the
  same outcome: the same outputs bit for bit with the same id, part count
  and attempts, checked against the golden or float64 reference values; or
  the same refusal (exception type, gRPC code, message, attempts). Each run
  also records the RPCs the server counted (``logprob_requests_total`` by
  method and code: Score, ScoreChunked, RegisterSharedMemory, ...), the
  ``on_retry`` events and the client's state after the call (its
  ``cuda_ipc`` option, its shared-memory session), which must agree too.
  ``score_stream``, ``health`` and ``server_info`` the same way.
- ApiParityTest (no server): both clients have the same public methods,
  parameters and defaults, and neither defines logic of its own (only the
  I/O hooks the core calls).
"""

import asyncio
import inspect
import os
import unittest
import warnings

import numpy as np

import support  # noqa: F401  (puts client/python on sys.path)
from support import LOGITS_CASES, Golden, Server, as_numpy_outputs, compare, free_port
import reference
from test_cuda_ipc import FakeCudaTensor

import grpc
from logprob_client import LogprobClient, LogprobError, RetryPolicy, aio
from logprob_client._internal import shared_memory
from logprob_client import logprob_pb2 as pb2
from logprob_client._internal.base import ClientBase
from logprob_client._internal.tensors import F32, I64, to_tensor

LM_HEAD = os.path.join(support.GOLDEN_DIR, "hidden_bf16.lm_head.safetensors")

try:
    import torch
except ImportError:  # scripts/install-deps.sh installs python3-torch
    torch = None


class Case:
    """One row of the table: ``score`` keyword arguments (made fresh for
    each client by ``make()``), the client's constructor arguments
    (``client``; ``target`` None: the test's server) and attributes
    (``attrs``: chunk_above, piece_bytes), and ``check(test, result)``:
    what the result must hold besides agreeing (expected values, part
    counts). ``refused``: the exception type both clients must raise."""

    def __init__(self, name, make, client=None, attrs=None, check=None, refused=None, target=None):
        self.name = name
        self.make = make
        self.client = dict(client or {})
        self.attrs = dict(attrs or {})
        self.check = check
        self.refused = refused
        self.target = target


def golden(name, **extra):
    """``make`` and ``check`` of a golden case (``extra``: more score arguments)."""
    g = Golden(name)

    def check(test, res):
        test.assertEqual(compare(g.expected, as_numpy_outputs(res.outputs)), "")

    return (lambda: dict(g.score_kwargs(), **extra)), check


def num_parts(n, then=None):
    """A check of the part count (and ``then``)."""

    def check(test, res):
        test.assertEqual(res.num_parts, n)
        if then is not None:
            then(test, res)

    return check


def replaced(arr, index, value):
    """A copy of ``arr`` with ``arr[index] = value``."""
    out = np.array(arr, copy=True)
    out[index] = value
    return out


def random_batch(id_0_5):
    """A padded f32 batch [3, 12, 257] with ids (``id_0_5`` at [0, 5]) and lengths."""
    rng = np.random.default_rng(7)
    logits = (rng.standard_normal((3, 12, 257)) * 3).astype(np.float32)
    ids = rng.integers(0, 257, size=(3, 12)).astype(np.int64)
    ids[0, 5] = id_0_5
    return logits, ids, np.array([12, 9, 5], dtype=np.int32)


def against_reference(**ref_kwargs):
    """``make`` and ``check`` of the random batch with ``ref_kwargs`` as
    score options, against the float64 reference (id -100 at [0, 5]
    unless ``ignore_index`` is given)."""
    logits, ids, lens = random_batch(3 if "ignore_index" in ref_kwargs else -100)
    gather = np.random.default_rng(1).integers(0, 257, size=(3, 12, 3)).astype(np.int32)
    names = {"temperature": "temperature", "sampling_top_k": "top_k", "sampling_top_p": "top_p",
             "topk": "topk", "alignment": "alignment", "ignore_index": "ignore_index"}
    with_gather = ref_kwargs.pop("gather", False)
    with np.errstate(invalid="ignore"):  # 0 * -inf of filtered tokens, masked by the reference
        ref = reference.score_padded(logits, ids, lens, gather=gather if with_gather else None,
                                     **{names[k]: v for k, v in ref_kwargs.items()})

    def make():
        kw = dict(logits=logits, input_ids=ids, seq_lens=lens, entropy=True, **ref_kwargs)
        if with_gather:
            kw["gather_indices"] = gather
        return kw

    def check(test, res):
        test.assertEqual(compare(ref, as_numpy_outputs(res.outputs)), "")

    return make, check


def cases():
    """The table."""
    out = []
    for name in LOGITS_CASES + ["hidden_bf16"]:
        make, check = golden(name)
        out.append(Case("golden " + name, make, check=check))
    make, check = against_reference(alignment="same_position", topk=5, temperature=1.3, gather=True)
    out.append(Case("same_position entropy topk gather temperature", make, check=check))
    make, check = against_reference(temperature=0.8, sampling_top_k=20, sampling_top_p=0.7, ignore_index=7)
    out.append(Case("sampling filters and ignore_index", make, check=check))

    basic = Golden("basic_f32")
    logits, ids = basic.inputs["logits"], basic.inputs["input_ids"]
    mask = np.ones(ids.shape, dtype=np.int64)
    left_padded = replaced(mask, (slice(None), slice(0, 10)), 0)  # zeros first
    make, check = golden("basic_f32")
    out.append(Case("attention_mask", lambda: dict(make(), attention_mask=mask), check=check))
    out.append(Case("request_id and per-call timeout", lambda: dict(make(), request_id="same-id", timeout=60),
                    check=check))
    out.append(Case("split by the client's max_tokens_per_request", make, client={"max_tokens_per_request": 100},
                    check=num_parts(4, check)))
    out.append(Case("split=False", lambda: dict(make(), split=False), client={"max_tokens_per_request": 100},
                    check=num_parts(1, check)))
    out.append(Case("chunked in pieces of 1000 bytes", make, client={"shared_memory": False},
                    attrs={"chunk_above": 0, "piece_bytes": 1000}, check=check))
    out.append(Case("inline, one Score message", make, client={"shared_memory": False},
                    attrs={"chunk_above": -1}, check=check))
    out.append(Case("shared memory", make, client={"shared_memory": True}, check=check))
    f16 = Golden("odd_vocab_f16")
    out.append(Case("float32 converted to f16", lambda: dict(f16.score_kwargs(),
                                                              logits=f16.inputs["logits"].astype(np.float32),
                                                              dtype="f16"),
                    check=golden("odd_vocab_f16")[1]))
    hidden = Golden("hidden_bf16")
    make_h, check_h = golden("hidden_bf16")
    out.append(Case("CUDA hidden states to a server without CUDA IPC",
                    lambda: dict(make_h(), hidden_states=FakeCudaTensor(hidden.inputs["hidden_states"])),
                    check=check_h))
    out.append(Case("cuda_ipc=False per call",
                    lambda: dict(make_h(), hidden_states=FakeCudaTensor(hidden.inputs["hidden_states"]),
                                 cuda_ipc=False),
                    check=check_h))
    if torch is not None:
        def torch_make():
            kw = make()
            kw["logits"] = torch.from_numpy(kw["logits"]).transpose(0, 1).contiguous().transpose(0, 1)
            return kw

        def torch_check(test, res):
            test.assertIsInstance(res.token_logprobs, torch.Tensor)
            check(test, res)

        out.append(Case("torch in, torch out (strided)", torch_make, check=torch_check))

    # Refusals: by the client before sending, by the server, by the deadline, by the retry policy.
    out += [
        Case("logits and hidden_states", lambda: dict(make(), hidden_states=logits), refused=LogprobError),
        Case("input_ids of another shape", lambda: dict(make(), input_ids=ids[:, :5]), refused=LogprobError),
        Case("unknown alignment", lambda: dict(make(), alignment="previous_token"), refused=LogprobError),
        Case("unknown option", lambda: dict(make(), top_p=0.9), refused=TypeError),
        Case("integer logits", lambda: dict(make(), logits=logits.astype(np.int32)), refused=TypeError),
        Case("uint16 logits without dtype", lambda: dict(make(), logits=logits.view(np.uint16)), refused=TypeError),
        Case("left-padded attention_mask", lambda: dict(make(), attention_mask=left_padded), refused=LogprobError),
        Case("cu_seqlens with padded input", lambda: dict(make(), cu_seqlens=[0, 64]), refused=LogprobError),
        Case("a sequence over the client's max_request_bytes", make, client={"max_request_bytes": 150000},
             refused=LogprobError),
        Case("server refuses a target id", lambda: dict(make(), input_ids=replaced(ids, (1, 3), 10 ** 6)),
             refused=LogprobError),
        Case("server refuses a negative temperature", lambda: dict(make(), temperature=-1.0), refused=LogprobError),
        Case("hidden states of another hidden size",
             lambda: dict(make_h(), hidden_states=np.zeros((2, 32, 100), np.float32)), refused=LogprobError),
        Case("a timeout of 0", lambda: dict(make(), timeout=0), refused=LogprobError),
        Case("nothing listening: bounded retries", make, target="127.0.0.1:%d" % free_port(),
             client={"retry": RetryPolicy(max_attempts=3, initial_backoff=0.05, multiplier=2.0, jitter=0.0)},
             refused=LogprobError),
        Case("tls_cert without tls_key", make, client={"tls_ca": __file__, "tls_cert": __file__},
             refused=LogprobError),
        Case("an empty token", make, client={"token": "   "}, refused=LogprobError),
        Case("token and token_file", make, client={"token": "t", "token_file": __file__}, refused=LogprobError),
    ]
    return out


def requests_counted(server):
    """{(method, code): count} of the server's logprob_requests_total."""
    out = {}
    for line in server.metrics().splitlines():
        if line.startswith("logprob_requests_total{"):
            head, _, value = line.rpartition(" ")
            labels = dict(kv.split("=", 1) for kv in head[head.index("{") + 1:-1].split(","))
            out[(labels["method"].strip('"'), labels["code"].strip('"'))] = float(value)
    return out


def counted_since(before, after):
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def outcome_of(result=None, error=None):
    """What is compared of a call's outcome: everything a caller can see."""
    if error is not None:
        out = {"type": type(error).__name__, "text": str(error)}
        if isinstance(error, LogprobError):
            out.update(code=error.code, message=error.message, attempts=error.attempts, part=error.part)
        return out
    outputs = as_numpy_outputs(result.outputs)
    return {
        "id": result.id,
        "num_parts": result.num_parts,
        "attempts": result.attempts,
        "types": sorted((k, type(v).__name__) for k, v in result.outputs.items()),
        "outputs": {k: (v.dtype.str, v.shape, v.tobytes()) for k, v in outputs.items()},
    }


def state_of(client):
    """The client's state a call could change."""
    shm = client._shm
    return {"cuda_ipc": client.cuda_ipc, "shared_memory": type(shm).__name__ if shm is not True else "undecided"}


class ParityTest(unittest.IsolatedAsyncioTestCase):
    """Each case runs through the sync client (blocking this test's event
    loop, which the asyncio client does not use meanwhile), then through
    the asyncio client in the same loop."""

    @classmethod
    def setUpClass(cls):
        cls.server = Server(workers=2, extra=["--lm-head", LM_HEAD], metrics=True)
        cls.addClassCleanup(cls.server.close)
        cls.table = cases()

    async def asyncSetUp(self):
        # IsolatedAsyncioTestCase runs the loop in debug mode, which logs every
        # slow callback (the sync client's calls block it); not what is tested here.
        asyncio.get_running_loop().set_debug(False)

    def run_sync(self, case):
        events = []
        before = requests_counted(self.server)
        result = error = state = None
        try:
            with LogprobClient(case.target or self.server.address, on_retry=lambda *a: events.append(a),
                               **case.client) as c:
                for k, v in case.attrs.items():
                    setattr(c, k, v)
                try:
                    result = c.score(**case.make())
                except Exception as e:  # noqa: BLE001  (compared below)
                    error = e
                state = state_of(c)
        except Exception as e:  # noqa: BLE001  (the constructor's refusal)
            error = e
        return result, error, events, state, counted_since(before, requests_counted(self.server))

    async def run_aio(self, case):
        events = []
        before = requests_counted(self.server)
        result = error = state = None
        try:
            async with aio.LogprobClient(case.target or self.server.address, on_retry=lambda *a: events.append(a),
                                         **case.client) as c:
                for k, v in case.attrs.items():
                    setattr(c, k, v)
                try:
                    result = await c.score(**case.make())
                except Exception as e:  # noqa: BLE001  (compared below)
                    error = e
                state = state_of(c)
        except Exception as e:  # noqa: BLE001  (the constructor's refusal)
            error = e
        return result, error, events, state, counted_since(before, requests_counted(self.server))

    async def test_table_through_both_clients(self):
        names = [c.name for c in self.table]
        self.assertEqual(len(names), len(set(names)))
        for case in self.table:
            with self.subTest(case=case.name), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a token without TLS, CUDA IPC fallbacks
                s_result, s_error, s_events, s_state, s_rpcs = self.run_sync(case)
                a_result, a_error, a_events, a_state, a_rpcs = await self.run_aio(case)
                sync, asyncio_ = outcome_of(s_result, s_error), outcome_of(a_result, a_error)
                if case.refused is None:
                    self.assertIsNone(s_error, "sync: %r" % (s_error,))
                    self.assertIsNone(a_error, "aio: %r" % (a_error,))
                    case.check(self, s_result)
                    case.check(self, a_result)
                else:
                    self.assertIsInstance(s_error, case.refused)
                    self.assertIsInstance(a_error, case.refused)
                self.assertEqual(sync, asyncio_)
                self.assertEqual([(n, code, round(d, 6)) for n, code, _, d in s_events],
                                 [(n, code, round(d, 6)) for n, code, _, d in a_events])
                self.assertEqual(s_state, a_state)
                self.assertEqual(s_rpcs, a_rpcs)

    async def test_what_the_table_covers(self):
        # The transports and refusals the table means to compare, seen on the
        # server and in the outcomes (a case that silently took another path
        # would compare nothing of interest).
        by_name = {c.name: c for c in self.table}

        async def rpcs(name):
            return (await self.run_aio(by_name[name]))[4]

        self.assertIn(("ScoreChunked", "OK"), await rpcs("chunked in pieces of 1000 bytes"))
        self.assertEqual(await rpcs("inline, one Score message"), {("Score", "OK"): 1.0})
        shm = await rpcs("shared memory")
        self.assertEqual(shm.get(("RegisterSharedMemory", "OK")), 1.0)
        self.assertEqual(shm.get(("UnregisterSharedMemory", "OK")), 1.0)  # close()
        self.assertEqual(shm.get(("Score", "OK")), 1.0)
        with self.server.client() as c:
            self.assertEqual(c.server_info().host_id, shared_memory.host_id())
        self.assertEqual((await rpcs("split by the client's max_tokens_per_request"))[("Score", "OK")], 4.0)
        _, error, events, _, _ = await self.run_aio(by_name["nothing listening: bounded retries"])
        self.assertEqual((error.code, error.attempts), (grpc.StatusCode.UNAVAILABLE, 3))
        self.assertEqual([(n, round(d, 6)) for n, _, _, d in events], [(1, 0.05), (2, 0.1)])
        _, error, _, _, _ = await self.run_aio(by_name["server refuses a target id"])
        self.assertEqual((error.code, error.attempts), (grpc.StatusCode.INVALID_ARGUMENT, 1))
        _, error, _, _, _ = await self.run_aio(by_name["a timeout of 0"])
        self.assertEqual((error.code, error.attempts), (grpc.StatusCode.DEADLINE_EXCEEDED, 0))

    async def test_score_stream_health_and_server_info(self):
        g = Golden("sampling_f32")
        bad = g.score_kwargs()
        bad["input_ids"] = replaced(bad["input_ids"], (1, 3), 10 ** 6)
        prepared = pb2.ScoreRequest(id="prepared", inputs=[to_tensor("logits", F32, np.zeros((1, 3, 5), np.float32)),
                                                          to_tensor("input_ids", I64, np.zeros((1, 3), np.int64))])

        def items():
            return [dict(g.score_kwargs(), request_id="a"), bad, dict(g.score_kwargs(), input_ids=[1]),
                    prepared, dict(g.score_kwargs(), request_id="b", cuda_ipc=True), "not a request"]

        with LogprobClient(self.server.address) as c:
            sync = [outcome_of(error=x) if isinstance(x, LogprobError) else outcome_of(x)
                    for x in c.score_stream(items(), return_exceptions=True)]
            sync_info, sync_health = c.server_info(), c.health()

        async with aio.LogprobClient(self.server.address) as c:
            asyncio_ = [outcome_of(error=x) if isinstance(x, LogprobError) else outcome_of(x)
                        async for x in c.score_stream(items(), return_exceptions=True)]
            aio_info, aio_health = await c.server_info(), await c.health()
        self.assertEqual(sync, asyncio_)
        self.assertEqual([o.get("id", o.get("type")) for o in sync],
                         ["a", "LogprobError", "InvalidInputError", "prepared", "b", "InvalidInputError"])
        self.assertEqual(sync[1]["code"], grpc.StatusCode.INVALID_ARGUMENT)
        self.assertEqual(sync_info, aio_info)
        self.assertEqual(sync_info.workers, 2)
        self.assertTrue(sync_health and aio_health)


# The methods a client kind defines: the I/O hooks the core calls, and the public API.
IO_HOOKS = {"_open", "_chunked_rpc", "_perform", "_drive", "_run"}
API = {"close", "server_info", "health", "score_request", "score", "score_stream", "update_lm_head", "lm_heads",
       "begin_lm_head_update", "put_lm_head_rows", "commit_lm_head_update", "abort_lm_head_update", "backward",
       "read_head_gradients", "close_gradient_step", "distill"}


class ApiParityTest(unittest.TestCase):
    def test_same_public_methods_and_parameters(self):
        for name in API:
            with self.subTest(method=name):
                s = inspect.signature(getattr(LogprobClient, name))
                a = inspect.signature(getattr(aio.LogprobClient, name))
                self.assertEqual([(p.name, p.kind, p.default) for p in s.parameters.values()],
                                 [(p.name, p.kind, p.default) for p in a.parameters.values()])
                self.assertTrue(getattr(LogprobClient, name).__doc__)
                self.assertTrue(getattr(aio.LogprobClient, name).__doc__)
                if name != "score_stream":  # an async iterator, not a coroutine
                    self.assertTrue(inspect.iscoroutinefunction(getattr(aio.LogprobClient, name)))
        self.assertEqual(inspect.signature(LogprobClient.__init__), inspect.signature(aio.LogprobClient.__init__))
        self.assertTrue(hasattr(LogprobClient, "__enter__") and hasattr(aio.LogprobClient, "__aenter__"))

    def test_the_clients_define_only_io(self):
        # Every decision is the core's (ClientBase); a client kind only
        # performs I/O. A method added to one client alone fails here.
        for cls in (LogprobClient, aio.LogprobClient):
            with self.subTest(client=cls.__module__):
                own = {n for n in vars(cls) if not (n.startswith("__") and n.endswith("__"))}
                self.assertEqual(own, IO_HOOKS | API)
                self.assertTrue(issubclass(cls, ClientBase))


if __name__ == "__main__":
    unittest.main()

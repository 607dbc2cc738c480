// SmddpBackend's send, recv and recv from any source: handed to the group's point-to-point
// engines (shared memory for host-mates, TCP for other hosts), or staged for CUDA tensors.
#include <ATen/ATen.h>

#include "core/error.h"
#include "torch/backend.h"
#include "torch/staged.h"
#include "torch/tensor_checks.h"

namespace smddp::torchext {

c10::intrusive_ptr<c10d::Work> SmddpBackend::p2p(bool isSend, std::vector<at::Tensor>& tensors, int peer, int tag,
                                                 bool background) {
  const char* op = isSend ? "send" : "recv";
  throwIfForked(op);
  const at::Tensor& t = onlyTensor(tensors, who(), op);
  checkMovedTensor(t, who(), op);
  TORCH_CHECK_VALUE((peer == -1 && !isSend) || (peer >= 0 && peer < size_ && peer != rank_), who(),
                    ": ", op,
                    ": peer ", peer, " is not another rank of this group of size ", size_);
  TORCH_CHECK_VALUE(size_ > 1, who(), ": ", op, ": a group of one rank has no peer");
  if (isCudaOp(tensors, op)) return isSend ? cudaSend(t, peer, tag) : cudaRecv(t, peer, tag);
  // Posted at once (a send's data is read from here on): staged now.
  Staged s = isSend ? stageIn(t) : stageOut(t, who(), op);
  s.ready();
  auto work = newWork(isSend ? c10d::OpType::SEND : c10d::OpType::RECV, isSend ? "smddp:send" : "smddp:recv", tensors,
                      tensors, std::chrono::milliseconds(timeoutMs_.load()), {peer, tag});
  work->traceStarted();  // posted: from here on it moves as soon as its peer is there
  engine::P2pOp o = p2pOp(isSend, peer, tag, s.work, background);
  o.done = [work, s, peer](std::exception_ptr error, int source) {
    error = asTorchError(error, work->who());
    if (!error) {
      try {
        finishStaged(s);
      } catch (...) {
        error = std::current_exception();
      }
    }
    work->setSourceRank(peer >= 0 ? peer : source);
    work->complete(error);
  };
  if (isSend && sendsQueued_.load() > 0) {
    // A CUDA send issued earlier is still on its way to the engine (it waits for the device to
    // stage its data), or a send queued behind one: this one goes behind them, counted until it
    // reaches its engine, so that a send issued meanwhile does not overtake it either.
    auto submit = [this, o, queued = std::make_shared<QueuedSend>(sendsQueued_)]() mutable {
      try {
        submitP2p(o);
      } catch (...) {
        o.done(std::current_exception(), -1);
      }
    };
    try {
      progress_->enqueue(std::move(submit));
    } catch (const std::logic_error&) {
      C10_THROW_ERROR(DistBackendError,
                      c10::str(who(), ": send to rank ", peer, ": the process group has been shut down"));
    }
  } else {
    submitP2p(o, work.get());
  }
  return work;
}

engine::P2pOp SmddpBackend::p2pOp(bool isSend, int peer, int tag, const at::Tensor& buffer, bool background) const {
  engine::P2pOp o;
  o.isSend = isSend;
  o.peer = peer;
  o.tag = tag;
  o.buffer = static_cast<uint8_t*>(buffer.data_ptr());
  o.bytes = buffer.nbytes();
  o.posted = std::chrono::steady_clock::now();
  o.deadline = background ? std::chrono::steady_clock::time_point::max()
                          : o.posted + std::chrono::milliseconds(timeoutMs_.load());
  o.background = background;
  return o;
}

void SmddpBackend::submitP2p(engine::P2pOp o, SmddpWork* driven) {
  const Topology& topo = comm_->topology();
  const bool multiHost = comm_->multiHost();
  const int peer = o.peer;
  const bool remote = multiHost && peer >= 0 && topo.hostOf[peer] != topo.host();
  // The shared-memory engine numbers the ranks of its host.
  if (multiHost && peer >= 0 && !remote) o.peer = topo.localOf[peer];
  try {
    if (multiHost && peer < 0) {
      if (p2p_) {  // host-mates (the shared-memory engine exists only where there are some)
        // Any rank may send it: both engines look, the first match takes it (P2pOp::claim).
        o.sharedAnySource = std::make_shared<engine::SharedAnySource>();
        engine::P2pOp local = o;
        const std::vector<int> hostMates = topo.members[topo.host()];
        local.done = [done = o.done, hostMates](std::exception_ptr error, int source) {
          done(std::move(error), source >= 0 ? hostMates[source] : source);
        };
        p2p_->submit(std::move(local));
      } else if (driven) {
        // Only the sockets can answer it. With host-mates too, the waiter could drive only one
        // engine, and would not hear the other complete the op: it waits as usual then.
        driven->setP2pDriver(netP2p_);
      }
      netP2p_->submit(std::move(o));
    } else if (remote) {
      if (driven) driven->setP2pDriver(netP2p_);
      netP2p_->submit(std::move(o));
    } else {
      if (driven) driven->setP2pDriver(p2p_);
      p2p_->submit(std::move(o));
    }
  } catch (const Error& e) {  // e.g. /dev/shm too small for the mailboxes
    std::rethrow_exception(toTorchError(e, who()));
  }
}

c10::intrusive_ptr<c10d::Work> SmddpBackend::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  checkUserTag(tag, "send");
  return p2p(true, tensors, dstRank, tag);
}

c10::intrusive_ptr<c10d::Work> SmddpBackend::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  checkUserTag(tag, "recv");
  return p2p(false, tensors, srcRank, tag);
}

c10::intrusive_ptr<c10d::Work> SmddpBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  checkUserTag(tag, "recv");
  return p2p(false, tensors, -1, tag);
}

}  // namespace smddp::torchext

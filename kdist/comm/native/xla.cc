// XLA lowerings of kdist's collective ops: each op becomes a custom call that
// runs the same engine (engine.h) as the TensorFlow kernels, so a train step
// compiled with jit_compile=True reduces its gradients inside the compiled
// program. Host buffers are reduced in place; on a CUDA device the custom
// call copies through host memory on the program's stream.
//
// This file is built into its own library, on first use under XLA, because
// XLA's headers take a minute to compile. Its kernels are registered for the
// XLA_CPU_JIT and XLA_GPU_JIT devices directly, which also works when XLA has
// already started in this process.
#include <dlfcn.h>
#include <mpi.h>

#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "engine.h"
#include "tensorflow/compiler/tf2xla/xla_op_kernel.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "xla/ffi/api/ffi.h"
#include "xla/hlo/builder/xla_builder.h"
#include "xla/shape_util.h"

namespace xla::ffi {
const XLA_FFI_Api* GetXlaFfiApi();
}

namespace ffi = xla::ffi;
using tensorflow::OpKernelConstruction;
using tensorflow::XlaOpKernel;
using tensorflow::XlaOpKernelContext;

namespace {

// What a compiled collective does. The custom call carries only an index into
// this table; equal settings share one entry, so recompiling adds nothing.
struct Settings {
  int64_t kind = 0;
  int64_t comm = 0;
  int64_t dtype = 0;
  int64_t op = 1;
  bool average = false;
  float prescale = 1.0f;
  float postscale = 1.0f;
  int64_t direct_bytes = 262144;
  int64_t root = 0;
  std::string label;

  bool operator==(const Settings& other) const {
    return kind == other.kind && comm == other.comm && dtype == other.dtype &&
           op == other.op && average == other.average && prescale == other.prescale &&
           postscale == other.postscale && direct_bytes == other.direct_bytes &&
           root == other.root && label == other.label;
  }
};

std::mutex g_settings_mutex;
std::vector<Settings>* g_settings = new std::vector<Settings>();

int64_t Intern(const Settings& settings) {
  std::lock_guard<std::mutex> lock(g_settings_mutex);
  for (size_t i = 0; i < g_settings->size(); ++i) {
    if ((*g_settings)[i] == settings) return static_cast<int64_t>(i);
  }
  g_settings->push_back(settings);
  return static_cast<int64_t>(g_settings->size() - 1);
}

Settings Lookup(int64_t index) {
  std::lock_guard<std::mutex> lock(g_settings_mutex);
  return (*g_settings)[index];
}

MPI_Comm Comm(const Settings& settings) { return kdist::CurrentComm(settings.comm); }

ffi::Error ToError(const kdist::Status& status) {
  if (status.ok) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kAborted, status.message);
}

// -- host execution ----------------------------------------------------------

// Buffers as the engine sees them: host pointers and element counts.
struct HostCall {
  std::vector<const void*> in;
  std::vector<void*> out;
  std::vector<int64_t> counts;
};

kdist::Status Run(const Settings& s, HostCall& call, const std::vector<int64_t>& out_counts) {
  MPI_Comm comm = Comm(s);
  const int64_t element = kdist::ElementSize(s.dtype);
  if (s.kind == kdist::kAllreduce) {
    return kdist::FusedAllreduce(comm, static_cast<int>(call.in.size()), call.in.data(),
                                 call.out.data(), call.counts.data(), s.dtype, s.op, s.average,
                                 s.prescale, s.postscale, s.direct_bytes, s.label + " (XLA)");
  }
  if (s.kind == kdist::kBroadcast) {
    if (call.out[0] != call.in[0]) std::memcpy(call.out[0], call.in[0], call.counts[0] * element);
    return kdist::Broadcast(comm, call.out[0], call.counts[0], s.dtype,
                            static_cast<int>(s.root), s.label + " (XLA)");
  }
  // Allgather: the compiled output holds size x rows; ranks that joined give none.
  const int64_t rows = s.root;  // rows per rank, fixed when the program was compiled
  const int64_t row_elements = rows > 0 ? call.counts[0] / rows : 0;
  const int64_t capacity = out_counts[0];
  int64_t gathered = 0;
  std::vector<char> overflow;  // takes part in the exchange when the result does not fit
  kdist::Status status = kdist::Allgather(
      comm, call.in[0], rows, row_elements, s.dtype, s.label + " (XLA)",
      [&](int64_t total) -> void* {
        gathered = total * row_elements;
        if (gathered <= capacity) return call.out[0];
        overflow.resize(gathered * element);
        return overflow.data();
      });
  if (!status.ok) return status;
  if (gathered > capacity) {
    return kdist::Status::Error(
        "kdist: under XLA every rank must gather the same number of rows (the compiled "
        "program holds " + std::to_string(capacity / std::max<int64_t>(row_elements, 1)) +
        " rows, the ranks sent " + std::to_string(gathered / std::max<int64_t>(row_elements, 1)) +
        "); give every rank batches of the same size, or run this step without jit_compile");
  }
  if (gathered < capacity) {
    std::memset(static_cast<char*>(call.out[0]) + gathered * element, 0,
                (capacity - gathered) * element);
  }
  return status;
}

ffi::Error HostCollective(ffi::AnyBuffer settings, ffi::RemainingArgs args,
                          ffi::RemainingRets rets) {
  const Settings s = Lookup(*static_cast<const int64_t*>(settings.untyped_data()));
  HostCall call;
  std::vector<int64_t> out_counts;
  for (size_t i = 0; i < args.size(); ++i) {
    auto in = args.get<ffi::AnyBuffer>(i);
    auto out = rets.get<ffi::AnyBuffer>(i);
    if (!in.has_value() || !out.has_value()) {
      return ffi::Error::InvalidArgument("kdist: unexpected custom-call operands");
    }
    call.in.push_back(in->untyped_data());
    call.out.push_back((*out)->untyped_data());
    call.counts.push_back(static_cast<int64_t>(in->element_count()));
    out_counts.push_back(static_cast<int64_t>((*out)->element_count()));
  }
  return ToError(Run(s, call, out_counts));
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(kHostCollective, HostCollective,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets());

// -- CUDA execution, through host memory ------------------------------------------

// The CUDA driver, opened at run time so that building needs no CUDA headers.
struct CudaDriver {
  using CopyDtoH = int (*)(void*, unsigned long long, size_t, void*);
  using CopyHtoD = int (*)(unsigned long long, const void*, size_t, void*);
  using Sync = int (*)(void*);
  CopyDtoH to_host = nullptr;
  CopyHtoD to_device = nullptr;
  Sync synchronize = nullptr;

  static const CudaDriver* Get() {
    static CudaDriver* driver = [] {
      void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
      if (library == nullptr) return static_cast<CudaDriver*>(nullptr);
      CudaDriver* d = new CudaDriver();
      d->to_host = reinterpret_cast<CopyDtoH>(dlsym(library, "cuMemcpyDtoHAsync_v2"));
      d->to_device = reinterpret_cast<CopyHtoD>(dlsym(library, "cuMemcpyHtoDAsync_v2"));
      d->synchronize = reinterpret_cast<Sync>(dlsym(library, "cuStreamSynchronize"));
      if (!d->to_host || !d->to_device || !d->synchronize) return static_cast<CudaDriver*>(nullptr);
      return d;
    }();
    return driver;
  }
};

ffi::Error CudaCollective(void* stream, ffi::AnyBuffer settings, ffi::RemainingArgs args,
                          ffi::RemainingRets rets) {
  const CudaDriver* cuda = CudaDriver::Get();
  if (cuda == nullptr) return ffi::Error::Internal("kdist: the CUDA driver could not be opened");
  int64_t index = 0;
  if (cuda->to_host(&index, reinterpret_cast<unsigned long long>(settings.untyped_data()),
                    sizeof(index), stream) != 0 ||
      cuda->synchronize(stream) != 0) {
    return ffi::Error::Internal("kdist: reading the collective's settings from the GPU failed");
  }
  const Settings s = Lookup(index);
  const int64_t element = kdist::ElementSize(s.dtype);
  std::vector<std::vector<char>> host_in(args.size()), host_out(args.size());
  HostCall call;
  std::vector<int64_t> out_counts;
  std::vector<void*> device_out;
  for (size_t i = 0; i < args.size(); ++i) {
    auto in = args.get<ffi::AnyBuffer>(i);
    auto out = rets.get<ffi::AnyBuffer>(i);
    if (!in.has_value() || !out.has_value()) {
      return ffi::Error::InvalidArgument("kdist: unexpected custom-call operands");
    }
    host_in[i].resize(in->element_count() * element);
    host_out[i].resize((*out)->element_count() * element);
    if (!host_in[i].empty() &&
        cuda->to_host(host_in[i].data(), reinterpret_cast<unsigned long long>(in->untyped_data()),
                      host_in[i].size(), stream) != 0) {
      return ffi::Error::Internal("kdist: copying a tensor to the host failed");
    }
    call.in.push_back(host_in[i].data());
    call.out.push_back(host_out[i].data());
    call.counts.push_back(static_cast<int64_t>(in->element_count()));
    out_counts.push_back(static_cast<int64_t>((*out)->element_count()));
    device_out.push_back((*out)->untyped_data());
  }
  if (cuda->synchronize(stream) != 0) return ffi::Error::Internal("kdist: CUDA stream failed");
  ffi::Error error = ToError(Run(s, call, out_counts));
  if (!error.success()) return error;
  for (size_t i = 0; i < host_out.size(); ++i) {
    if (!host_out[i].empty() &&
        cuda->to_device(reinterpret_cast<unsigned long long>(device_out[i]), host_out[i].data(),
                        host_out[i].size(), stream) != 0) {
      return ffi::Error::Internal("kdist: copying a result to the GPU failed");
    }
  }
  if (cuda->synchronize(stream) != 0) return ffi::Error::Internal("kdist: CUDA stream failed");
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCudaCollective, CudaCollective,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets());

constexpr char kTarget[] = "kdist_collective";

XLA_FFI_REGISTER_HANDLER(xla::ffi::GetXlaFfiApi(), kTarget, "Host", kHostCollective);
XLA_FFI_REGISTER_HANDLER(xla::ffi::GetXlaFfiApi(), kTarget, "CUDA", kCudaCollective);

// -- the ops' XLA kernels -------------------------------------------------------------

Settings ReadSettings(OpKernelConstruction* context, int64_t kind) {
  Settings s;
  s.kind = kind;
  tensorflow::DataType type = tensorflow::DT_FLOAT;
  tensorflow::Status status = context->GetAttr("T", &type);
  s.dtype = static_cast<int64_t>(type);
  if (status.ok()) status = context->GetAttr("comm", &s.comm);
  if (status.ok()) status = context->GetAttr("label", &s.label);
  if (status.ok() && kind == kdist::kAllreduce) {
    status = context->GetAttr("reduce_op", &s.op);
    if (status.ok()) status = context->GetAttr("average", &s.average);
    if (status.ok()) status = context->GetAttr("prescale", &s.prescale);
    if (status.ok()) status = context->GetAttr("postscale", &s.postscale);
    if (status.ok()) status = context->GetAttr("direct_bytes", &s.direct_bytes);
  }
  if (status.ok() && kind == kdist::kBroadcast) status = context->GetAttr("root", &s.root);
  if (!status.ok()) context->CtxFailure(__FILE__, __LINE__, status);
  return s;
}

class CollectiveXlaOp : public XlaOpKernel {
 public:
  CollectiveXlaOp(OpKernelConstruction* context, int64_t kind)
      : XlaOpKernel(context), settings_(ReadSettings(context, kind)) {
    if (kind == kdist::kAllgather) {
      OP_REQUIRES_OK(context, context->GetAttr("size", &size_));
    }
  }

  void Compile(XlaOpKernelContext* context) override {
    xla::XlaBuilder* builder = context->builder();
    Settings s = settings_;
    std::vector<xla::XlaOp> operands;
    std::vector<xla::Shape> shapes;
    for (int i = 0; i < context->num_inputs(); ++i) {
      auto shape = context->InputXlaShape(i);
      OP_REQUIRES_OK(context, shape.status());
      xla::Shape out = *shape;
      if (s.kind == kdist::kAllgather) {
        OP_REQUIRES(context, out.dimensions().size() >= 1,
                    tensorflow::errors::InvalidArgument(
                        "kdist allgather needs a tensor of at least one dimension"));
        s.root = out.dimensions(0);  // rows per rank, see Run()
        out.set_dimensions(0, out.dimensions(0) * size_);
      }
      operands.push_back(context->Input(i));
      shapes.push_back(out);
    }
    operands.insert(operands.begin(), xla::ConstantR0<int64_t>(builder, Intern(s)));
    xla::XlaOp call = xla::CustomCall(
        builder, kTarget, operands, xla::ShapeUtil::MakeTupleShape(shapes), /*opaque=*/"",
        /*has_side_effect=*/true, /*output_operand_aliasing=*/{}, /*literal=*/nullptr,
        xla::CustomCallSchedule::SCHEDULE_NONE, xla::CustomCallApiVersion::API_VERSION_TYPED_FFI);
    for (int i = 0; i < context->num_inputs(); ++i) {
      context->SetOutput(i, xla::GetTupleElement(call, i));
    }
  }

 private:
  Settings settings_;
  int64_t size_ = 1;
};

class AllreduceXlaOp : public CollectiveXlaOp {
 public:
  explicit AllreduceXlaOp(OpKernelConstruction* c) : CollectiveXlaOp(c, kdist::kAllreduce) {}
};
class AllgatherXlaOp : public CollectiveXlaOp {
 public:
  explicit AllgatherXlaOp(OpKernelConstruction* c) : CollectiveXlaOp(c, kdist::kAllgather) {}
};
class BroadcastXlaOp : public CollectiveXlaOp {
 public:
  explicit BroadcastXlaOp(OpKernelConstruction* c) : CollectiveXlaOp(c, kdist::kBroadcast) {}
};

}  // namespace

#define KDIST_XLA_KERNEL(op, kernel)                                     \
  REGISTER_KERNEL_BUILDER(Name(op).Device(tensorflow::DEVICE_CPU_XLA_JIT), kernel); \
  REGISTER_KERNEL_BUILDER(Name(op).Device(tensorflow::DEVICE_GPU_XLA_JIT), kernel)

KDIST_XLA_KERNEL("KdistAllreduce", AllreduceXlaOp);
KDIST_XLA_KERNEL("KdistAllgather", AllgatherXlaOp);
KDIST_XLA_KERNEL("KdistBroadcast", BroadcastXlaOp);

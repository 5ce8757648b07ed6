// TensorFlow ops over kdist's collective engine (engine.h): they run MPI from
// inside a graph, with no Python on the way.
#include <mpi.h>

#include <cstring>
#include <string>
#include <vector>

#include "engine.h"
#include "fusion.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

using namespace tensorflow;

namespace {

constexpr char kNumericTypes[] =
    "T: {float, double, half, bfloat16, int32, int64, uint8, int8, int16, uint16, uint32, "
    "uint64, bool}";

// The communicator's Fortran handle, resolved each time the op runs
// (kdist::CurrentComm): a fault-tolerant job may have replaced it since.
int64_t CommAttr(OpKernelConstruction* context) {
  int64_t handle = 0;
  Status status = context->GetAttr("comm", &handle);
  if (!status.ok()) context->CtxFailure(__FILE__, __LINE__, status);
  return handle;
}

// Ranks that run different collectives fail with FailedPrecondition, as
// Horovod's ops do, so that scripts catching it keep working; anything else
// (MPI itself failed) aborts.
::tensorflow::Status ToTensorFlow(const kdist::Status& status) {
  static const std::string kMismatch = "kdist: the ranks are not running the same collective";
  if (status.message.compare(0, kMismatch.size(), kMismatch) == 0) {
    return errors::FailedPrecondition(status.message);
  }
  return errors::Aborted(status.message);
}

// The attributes both allreduce ops take.
struct ReductionAttrs {
  int64_t comm = 0;  // a Fortran handle: see CommAttr
  int64_t dtype = 1;
  int64_t op = 1;
  bool average = false;
  float prescale = 1.0f;
  float postscale = 1.0f;
  int64_t direct_bytes = 262144;

  void Read(OpKernelConstruction* context) {
    comm = CommAttr(context);
    DataType type;
    OP_REQUIRES_OK(context, context->GetAttr("T", &type));
    dtype = static_cast<int64_t>(type);
    OP_REQUIRES_OK(context, context->GetAttr("reduce_op", &op));
    OP_REQUIRES_OK(context, context->GetAttr("average", &average));
    OP_REQUIRES_OK(context, context->GetAttr("prescale", &prescale));
    OP_REQUIRES_OK(context, context->GetAttr("postscale", &postscale));
    OP_REQUIRES_OK(context, context->GetAttr("direct_bytes", &direct_bytes));
  }
};

}  // namespace

REGISTER_OP("KdistAllreduce")
    .Input("tensors: N * T")
    .Output("reduced: N * T")
    .Attr(kNumericTypes)
    .Attr("N: int >= 1")
    .Attr("comm: int")
    .Attr("reduce_op: int = 1")
    .Attr("average: bool = false")
    .Attr("prescale: float = 1.0")
    .Attr("postscale: float = 1.0")
    .Attr("direct_bytes: int = 262144")
    .Attr("label: string = ''")
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      for (int i = 0; i < c->num_inputs(); ++i) c->set_output(i, c->input(i));
      return OkStatus();
    });

class KdistAllreduceOp : public OpKernel {
 public:
  explicit KdistAllreduceOp(OpKernelConstruction* context) : OpKernel(context) {
    attrs_.Read(context);
    OP_REQUIRES_OK(context, context->GetAttr("label", &label_));
  }

  void Compute(OpKernelContext* context) override {
    const int n = context->num_inputs();
    std::vector<const void*> in(n);
    std::vector<void*> out(n);
    std::vector<int64_t> counts(n), shape_keys(n);
    std::vector<std::vector<int64_t>> shapes(n);
    for (int i = 0; i < n; ++i) {
      const Tensor& input = context->input(i);
      for (int d = 0; d < input.dims(); ++d) shapes[i].push_back(input.dim_size(d));
      shape_keys[i] = kdist::ShapeKey(shapes[i].data(), input.dims());
      Tensor* output = nullptr;
      // A tensor nobody else holds is reduced in its own buffer.
      OP_REQUIRES_OK(context,
                     context->forward_input_or_allocate_output({i}, i, input.shape(), &output));
      in[i] = input.data();
      out[i] = output->data();
      counts[i] = input.NumElements();
    }
    const ReductionAttrs& a = attrs_;
    kdist::Status status = kdist::FusedAllreduce(
        kdist::CurrentComm(a.comm), n, in.data(), out.data(), counts.data(), a.dtype, a.op,
        a.average, a.prescale, a.postscale, a.direct_bytes, Label(shapes), shape_keys.data());
    OP_REQUIRES(context, status.ok, ToTensorFlow(status));
  }

 private:
  std::string Label(const std::vector<std::vector<int64_t>>& shapes) const {
    std::string text = label_.empty() ? std::string("allreduce") : label_;
    text += ", " + std::to_string(shapes.size()) + " tensor(s) of shapes [";
    for (size_t i = 0; i < shapes.size() && i < 8; ++i) {
      text += i ? ", [" : "[";
      for (size_t d = 0; d < shapes[i].size(); ++d) {
        text += (d ? ", " : "") + std::to_string(shapes[i][d]);
      }
      text += "]";
    }
    return text + (shapes.size() > 8 ? ", ...]" : "]");
  }

  ReductionAttrs attrs_;
  std::string label_;
};

REGISTER_KERNEL_BUILDER(Name("KdistAllreduce").Device(DEVICE_CPU), KdistAllreduceOp);

// One tensor's allreduce through the fusion queue (fusion.h): an asynchronous
// kernel, so that a step's allreduces wait in the queue together. It is
// stateful (TensorFlow never folds, merges or moves it), and graph_ops exempts
// its type from running in program order, as TensorFlow's own collectives are,
// so that TensorFlow starts each as soon as its tensor exists. graph_ops only
// builds it in the outermost graph of a tf.function, where every rank runs the
// same graph and node names are the same on every rank.
REGISTER_OP("KdistAllreduceAsync")
    .Input("tensor: T")
    .Output("reduced: T")
    .Attr(kNumericTypes)
    .Attr("comm: int")
    .Attr("reduce_op: int = 1")
    .Attr("average: bool = false")
    .Attr("prescale: float = 1.0")
    .Attr("postscale: float = 1.0")
    .Attr("direct_bytes: int = 262144")
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(0));
      return OkStatus();
    });

class KdistAllreduceAsyncOp : public AsyncOpKernel {
 public:
  explicit KdistAllreduceAsyncOp(OpKernelConstruction* context) : AsyncOpKernel(context) {
    attrs_.Read(context);
    const ReductionAttrs& a = attrs_;
    key_ = kdist::Hash(name().data(), name().size(), 0);
    // The scales by their bits: the queue groups tensors by exact equality.
    int32_t prescale_bits = 0, postscale_bits = 0;
    std::memcpy(&prescale_bits, &a.prescale, sizeof(float));
    std::memcpy(&postscale_bits, &a.postscale, sizeof(float));
    const int64_t settings[5] = {a.op, a.average ? 1 : 0, prescale_bits, postscale_bits,
                                 a.direct_bytes};
    settings_ = kdist::Hash(settings, sizeof(settings), 0);
  }

  void ComputeAsync(OpKernelContext* context, DoneCallback done) override {
    const Tensor& input = context->input(0);
    Tensor* output = nullptr;
    OP_REQUIRES_OK_ASYNC(
        context, context->forward_input_or_allocate_output({0}, 0, input.shape(), &output),
        done);
    kdist::FusionRequest request;
    request.name = name();
    request.key = key_;
    std::vector<int64_t> dims(input.dims());
    for (int i = 0; i < input.dims(); ++i) dims[i] = input.dim_size(i);
    request.form = kdist::Hash(dims.data(), dims.size() * sizeof(int64_t), settings_);
    const ReductionAttrs& a = attrs_;
    request.dtype = a.dtype;
    request.count = input.NumElements();
    request.op = a.op;
    request.average = a.average;
    request.prescale = a.prescale;
    request.postscale = a.postscale;
    request.direct_bytes = a.direct_bytes;
    request.in = input.data();
    request.out = output->data();
    request.done = [context, done](const kdist::Status& status) {
      if (!status.ok) context->SetStatus(ToTensorFlow(status));
      done();
    };
    kdist::EnqueueAllreduce(kdist::CurrentComm(attrs_.comm), std::move(request));
  }

 private:
  ReductionAttrs attrs_;
  int64_t key_ = 0;
  int64_t settings_ = 0;
};

REGISTER_KERNEL_BUILDER(Name("KdistAllreduceAsync").Device(DEVICE_CPU), KdistAllreduceAsyncOp);

REGISTER_OP("KdistAllgather")
    .Input("tensor: T")
    .Output("gathered: T")
    .Attr(kNumericTypes)
    .Attr("comm: int")
    .Attr("size: int = 1")
    .Attr("label: string = ''")
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle input = c->input(0);
      if (!c->RankKnown(input)) {
        c->set_output(0, c->UnknownShape());
        return OkStatus();
      }
      shape_inference::ShapeHandle rest;
      TF_RETURN_IF_ERROR(c->Subshape(input, 1, &rest));
      shape_inference::ShapeHandle out;
      TF_RETURN_IF_ERROR(c->Concatenate(c->Vector(c->UnknownDim()), rest, &out));
      c->set_output(0, out);
      return OkStatus();
    });

class KdistAllgatherOp : public OpKernel {
 public:
  explicit KdistAllgatherOp(OpKernelConstruction* context) : OpKernel(context) {
    comm_ = CommAttr(context);
    DataType type;
    OP_REQUIRES_OK(context, context->GetAttr("T", &type));
    dtype_ = static_cast<int64_t>(type);
    OP_REQUIRES_OK(context, context->GetAttr("label", &label_));
  }

  void Compute(OpKernelContext* context) override {
    const Tensor& input = context->input(0);
    OP_REQUIRES(context, input.dims() >= 1,
                errors::InvalidArgument("kdist allgather needs a tensor of at least one "
                                        "dimension; got a scalar"));
    const int64_t rows = input.dim_size(0);
    TensorShape row_shape = input.shape();
    row_shape.RemoveDim(0);
    Tensor* output = nullptr;
    Status allocation;
    kdist::Status status = kdist::Allgather(
        kdist::CurrentComm(comm_), input.data(), rows, row_shape.num_elements(), dtype_,
        label_,
        [&](int64_t total) -> void* {
          TensorShape shape = row_shape;
          shape.InsertDim(0, total);
          allocation = context->allocate_output(0, shape, &output);
          return allocation.ok() ? output->data() : nullptr;
        });
    OP_REQUIRES_OK(context, allocation);
    OP_REQUIRES(context, status.ok, ToTensorFlow(status));
  }

 private:
  int64_t comm_ = 0;  // a Fortran handle: see CommAttr
  int64_t dtype_ = 1;
  std::string label_;
};

REGISTER_KERNEL_BUILDER(Name("KdistAllgather").Device(DEVICE_CPU), KdistAllgatherOp);

REGISTER_OP("KdistBroadcast")
    .Input("tensor: T")
    .Output("broadcast: T")
    .Attr(kNumericTypes)
    .Attr("comm: int")
    .Attr("root: int = 0")
    .Attr("label: string = ''")
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(0));
      return OkStatus();
    });

class KdistBroadcastOp : public OpKernel {
 public:
  explicit KdistBroadcastOp(OpKernelConstruction* context) : OpKernel(context) {
    comm_ = CommAttr(context);
    DataType type;
    OP_REQUIRES_OK(context, context->GetAttr("T", &type));
    dtype_ = static_cast<int64_t>(type);
    OP_REQUIRES_OK(context, context->GetAttr("root", &root_));
    OP_REQUIRES_OK(context, context->GetAttr("label", &label_));
  }

  void Compute(OpKernelContext* context) override {
    const Tensor& input = context->input(0);
    Tensor* output = nullptr;
    OP_REQUIRES_OK(context,
                   context->forward_input_or_allocate_output({0}, 0, input.shape(), &output));
    if (output->data() != input.data() && input.TotalBytes() > 0) {
      std::memcpy(output->data(), input.data(), input.TotalBytes());
    }
    kdist::Status status =
        kdist::Broadcast(kdist::CurrentComm(comm_), output->data(), input.NumElements(),
                         dtype_, static_cast<int>(root_), label_);
    OP_REQUIRES(context, status.ok, ToTensorFlow(status));
  }

 private:
  int64_t comm_ = 0;  // a Fortran handle: see CommAttr
  int64_t dtype_ = 1;
  int64_t root_ = 0;
  std::string label_;
};

REGISTER_KERNEL_BUILDER(Name("KdistBroadcast").Device(DEVICE_CPU), KdistBroadcastOp);

// KdistMpiLibrary: the MPI library these ops were built against, so that Python
// can check it is the one mpi4py uses before trusting them with a communicator.
REGISTER_OP("KdistMpiLibrary").Output("version: string").SetIsStateful();

class KdistMpiLibraryOp : public OpKernel {
 public:
  explicit KdistMpiLibraryOp(OpKernelConstruction* context) : OpKernel(context) {}

  void Compute(OpKernelContext* context) override {
    char version[MPI_MAX_LIBRARY_VERSION_STRING];
    int length = 0;
    MPI_Get_library_version(version, &length);
    Tensor* output = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, TensorShape({}), &output));
    output->scalar<tstring>()() = std::string(version, length);
  }
};

REGISTER_KERNEL_BUILDER(Name("KdistMpiLibrary").Device(DEVICE_CPU), KdistMpiLibraryOp);

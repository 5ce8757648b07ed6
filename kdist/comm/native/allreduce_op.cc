// KdistAllreduce: averages a list of float32 tensors across an MPI communicator
// inside a TensorFlow graph, with no Python on the way.
//
// The wire protocol is the one of kdist.comm.fusion.FusedReducer without
// compression, so that a rank which has joined (and feeds zeros from Python)
// takes part in exactly the same collectives:
//   1. tensors smaller than `direct_bytes` are packed, pre-divided by the world
//      size, into one buffer whose extra last element is 1 (a participation
//      count), and summed with one MPI_Allreduce;
//   2. each larger tensor is summed straight from its input into its output,
//      then divided by the count read in step 1.
#include <mpi.h>

#include <cstring>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

using namespace tensorflow;

REGISTER_OP("KdistAllreduce")
    .Input("tensors: N * float")
    .Output("reduced: N * float")
    .Attr("N: int >= 1")
    .Attr("comm: int")
    .Attr("average: bool = true")
    .Attr("direct_bytes: int = 262144")
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      for (int i = 0; i < c->num_inputs(); ++i) c->set_output(i, c->input(i));
      return OkStatus();
    });

class KdistAllreduceOp : public OpKernel {
 public:
  explicit KdistAllreduceOp(OpKernelConstruction* context) : OpKernel(context) {
    int64_t handle;
    OP_REQUIRES_OK(context, context->GetAttr("comm", &handle));
    OP_REQUIRES_OK(context, context->GetAttr("average", &average_));
    OP_REQUIRES_OK(context, context->GetAttr("direct_bytes", &direct_bytes_));
    comm_ = MPI_Comm_f2c(static_cast<MPI_Fint>(handle));
    MPI_Comm_size(comm_, &size_);
  }

  void Compute(OpKernelContext* context) override {
    const int n = context->num_inputs();
    std::vector<bool> direct(n);
    int64_t packed = 0;
    for (int i = 0; i < n; ++i) {
      const Tensor& input = context->input(i);
      direct[i] = input.TotalBytes() >= static_cast<size_t>(direct_bytes_);
      if (!direct[i]) packed += input.NumElements();
    }
    const float prescale = average_ ? 1.0f / size_ : 1.0f;
    buffer_.resize(packed + 1);
    int64_t offset = 0;
    for (int i = 0; i < n; ++i) {
      if (direct[i]) continue;
      const float* in = context->input(i).flat<float>().data();
      const int64_t count = context->input(i).NumElements();
      float* packed_at = buffer_.data() + offset;
      for (int64_t j = 0; j < count; ++j) packed_at[j] = in[j] * prescale;
      offset += count;
    }
    buffer_[packed] = 1.0f;
    OP_REQUIRES(context, Sum(buffer_.data(), buffer_.data(), packed + 1, true),
                errors::Internal("kdist: MPI_Allreduce of packed gradients failed"));
    const float contributors = buffer_[packed];
    // Ranks that joined sent zeros: average over the ranks that trained.
    const float rescale =
        average_ && contributors > 0 && contributors < size_ ? size_ / contributors : 1.0f;
    const float postscale = average_ && contributors > 0 ? 1.0f / contributors : 1.0f;
    offset = 0;
    for (int i = 0; i < n; ++i) {
      const Tensor& input = context->input(i);
      Tensor* output = nullptr;
      // A gradient nobody else holds is reduced in its own buffer: no allocation,
      // and MPI touches one buffer instead of two.
      OP_REQUIRES_OK(context, context->forward_input_or_allocate_output(
                                  {i}, i, input.shape(), &output));
      float* out = output->flat<float>().data();
      const int64_t count = output->NumElements();
      if (direct[i]) {
        const float* in = input.flat<float>().data();
        OP_REQUIRES(context, Sum(in, out, count, in == out),
                    errors::Internal("kdist: MPI_Allreduce of a gradient failed"));
        if (postscale != 1.0f) {
          for (int64_t j = 0; j < count; ++j) out[j] *= postscale;
        }
      } else {
        const float* packed_at = buffer_.data() + offset;
        for (int64_t j = 0; j < count; ++j) out[j] = packed_at[j] * rescale;
        offset += count;
      }
    }
  }

 private:
  bool Sum(const float* send, float* recv, int64_t count, bool in_place) {
    return MPI_Allreduce(in_place ? MPI_IN_PLACE : send, recv, static_cast<int>(count),
                         MPI_FLOAT, MPI_SUM, comm_) == MPI_SUCCESS;
  }

  MPI_Comm comm_;
  int size_ = 1;
  bool average_ = true;
  int64_t direct_bytes_ = 262144;
  std::vector<float> buffer_;
};

REGISTER_KERNEL_BUILDER(Name("KdistAllreduce").Device(DEVICE_CPU), KdistAllreduceOp);

// KdistMpiLibrary: the MPI library this op was built against, so that Python can
// check it is the one mpi4py uses before trusting the op with a communicator.
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

// Fused CPU kernels of the units, forward and backward in C++ (built by linearize/kernels.py): the PReLU of
// ReLU-family units (prelu) and the blend of smooth units (blend, at the end of this file).
//
// Input x: contiguous [N, C, *S] (channels at dim 1) or [N, C]; slopes w: [C]. The maps are viewed as
// [N, K] rows with K = C * prod(S) and the slopes repeated prod(S) times, so every loop runs over
// contiguous memory whatever the map size (PyTorch's broadcasting kernels loop innermost over S). The blend
// takes that repeat count (inner) as an argument: channels last ([..., C], inner 1) and one slope per
// position of a map ([N, *map] with P slopes, inner 1) run on the caller's tensors, never on a view of them.
//
//   forward:  y = x > 0 ? x : w * x, and ReLU's 0 where w == 0 and x < 0 (w * x would give -0, and
//             NaN at x = -inf): a zero slope computes ReLU bit for bit, a slope of 1 the identity
//   backward: grad_x = x > 0 ? g : w * g (0 where w == 0)  (one pass that also accumulates ...)
//             grad_w = sum over N and S of g * min(x, 0)   (... per element of K, then summed over S)
//             where x = -inf adds nothing to grad_w
//
// These are PyTorch's PReLU gradients (slope w at x = 0 too), except that an infinite input carries no
// slope gradient (PyTorch's adds g * -inf, or NaN where g = 0): the unit's output there is infinite for
// every w > 0, and a non-finite slope gradient at every step would make an fp16 GradScaler skip every
// step, though ReLU (w = 0) trains on such inputs. The backward is one pass over g and x
// instead of the five of a composition of ATen ops, and the autograd node is C++, so a training step
// pays no Python per call. When the backward itself is differentiated (create_graph=True), or gets a batched
// gradient (vmap: jacobian(vectorize=True), grad(is_grads_batched=True)), it uses ATen ops with the same formulas.
#include <torch/extension.h>

#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>

using torch::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

namespace {

// One row segment of the forward (computed in float for bfloat16 and half: the product of two such
// values is exact in float, so it rounds once, as ATen's prelu does).
template <typename scalar_t>
void forward_row(const scalar_t* __restrict__ x, const scalar_t* __restrict__ w, scalar_t* __restrict__ y,
                 int64_t len) {
  using acc_t = at::opmath_type<scalar_t>;
  for (int64_t k = 0; k < len; ++k) {
    const acc_t xv = x[k], wv = w[k];
    const acc_t neg = wv == acc_t(0) && xv < acc_t(0) ? acc_t(0) : wv * xv;
    y[k] = xv > acc_t(0) ? xv : neg;
  }
}

// x: contiguous, read as [N, K]; w_rep: [K]. Rows are split over threads in blocks of about 32k elements. The
// result has x's shape: a view made inside a Function would make autograd refuse in-place ops after the unit.
Tensor fused_forward(const Tensor& x, const Tensor& w_rep) {
  const int64_t K = w_rep.numel(), N = x.numel() / K;
  Tensor y = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "linearize_prelu_forward", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* wp = w_rep.const_data_ptr<scalar_t>();
    scalar_t* yp = y.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, N, std::max<int64_t>(1, 32768 / K), [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) forward_row<scalar_t>(xp + n * K, wp, yp + n * K, K);
    });
  });
  return y;
}

// One row segment of the backward. Both branches are computed and selected, so the loop vectorizes (with
// -fno-trapping-math the compiler may evaluate w * g where x > 0).
template <typename scalar_t, typename acc_t>
void backward_row(const scalar_t* __restrict__ x, const scalar_t* __restrict__ g, const scalar_t* __restrict__ w,
                  scalar_t* __restrict__ grad_x, acc_t* __restrict__ acc, int64_t len) {
  for (int64_t k = 0; k < len; ++k) {
    const acc_t xv = x[k], gv = g[k];
    const acc_t wv = w[k];
    const acc_t wg = wv == acc_t(0) ? acc_t(0) : wv * gv;  // ReLU's 0 at w = 0, also for g = +-inf or NaN
    const acc_t neg = std::min(xv, acc_t(0));
    grad_x[k] = xv > acc_t(0) ? gv : wg;
    acc[k] += neg == -std::numeric_limits<acc_t>::infinity() ? acc_t(0) : gv * neg;
  }
}

// g, x: contiguous [N, K]; w_rep: [K]. Returns grad_x [N, K] and the per-element slope gradient [K]
// (accumulated in float for float, bfloat16 and half, in double for double). Rows are cut into blocks
// of about 32k elements, a size that does not depend on the thread count; each block accumulates its
// own partial sums, added in block order at the end, so the result is the same for any thread count.
std::tuple<Tensor, Tensor> fused_backward(const Tensor& g, const Tensor& x, const Tensor& w_rep) {
  const int64_t K = w_rep.numel(), N = x.numel() / K;
  Tensor grad_x = at::empty_like(x);
  Tensor acc;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "linearize_prelu_backward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const int64_t rows = std::max<int64_t>(1, 32768 / K);
    const int64_t blocks = (N + rows - 1) / rows;
    Tensor partial = at::zeros({blocks, K}, x.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* gp = g.const_data_ptr<scalar_t>();
    const scalar_t* wp = w_rep.const_data_ptr<scalar_t>();
    scalar_t* gxp = grad_x.mutable_data_ptr<scalar_t>();
    acc_t* pp = partial.mutable_data_ptr<acc_t>();
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b)
        for (int64_t n = b * rows; n < std::min(N, (b + 1) * rows); ++n)
          backward_row<scalar_t, acc_t>(xp + n * K, gp + n * K, wp, gxp + n * K, pp + b * K, K);
    });
    acc = blocks > 1 ? partial.sum(0) : partial.view({K});
  });
  return {grad_x, acc};
}

int64_t inner_size(const Tensor& x) {
  int64_t s = 1;
  for (int64_t d = 2; d < x.dim(); ++d) s *= x.size(d);
  return s;
}

// [C] -> [C * s], each slope s times (an expand and one copy: repeat_interleave costs ~15 us per call)
Tensor repeat_slopes(const Tensor& w, int64_t s) {
  return s > 1 ? w.unsqueeze(1).expand({w.numel(), s}).reshape({-1}) : w;
}

// Smooth units: y = w == 0 ? a : w == 1 ? x : lerp(a, x, w), with a = act(x) computed before; lerp as ATen's
// vectorized one, fma(c, x - a, base) with (c, base) = (w, a) for |w| < 0.5 and (w - 1, x) otherwise. The ends
// are selected, not computed: lerp gives NaN there wherever x - a is infinite, and +0 for a = -0. Between
// them, where x - a is not finite (an infinite x, an activation that overflowed on a finite x, a difference that
// overflows) the value is the definition's (1 - w) a + w x (+-inf where lerp's x - a is inf - inf).
template <typename scalar_t>
void blend_forward_row(const scalar_t* __restrict__ a, const scalar_t* __restrict__ x, const scalar_t* __restrict__ w,
                       scalar_t* __restrict__ y, int64_t len) {
  using acc_t = at::opmath_type<scalar_t>;
  for (int64_t k = 0; k < len; ++k) {
    const acc_t av = a[k], xv = x[k], wv = w[k];
    const bool small = std::abs(wv) < acc_t(0.5);
    const acc_t diff = xv - av;
    const acc_t mixed = std::isfinite(diff) ? std::fma(small ? wv : wv - acc_t(1), diff, small ? av : xv)
                                            : (acc_t(1) - wv) * av + wv * xv;
    y[k] = wv == acc_t(0) ? av : (wv == acc_t(1) ? xv : mixed);
  }
}

// a, x: contiguous, read as [N, K]; w_rep: [K]. The result has x's shape (as fused_forward's).
Tensor fused_blend_forward(const Tensor& a, const Tensor& x, const Tensor& w_rep) {
  const int64_t K = w_rep.numel(), N = x.numel() / K;
  Tensor y = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "linearize_blend_forward", [&] {
    const scalar_t* ap = a.const_data_ptr<scalar_t>();
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* wp = w_rep.const_data_ptr<scalar_t>();
    scalar_t* yp = y.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, N, std::max<int64_t>(1, 32768 / K), [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) blend_forward_row<scalar_t>(ap + n * K, xp + n * K, wp, yp + n * K, K);
    });
  });
  return y;
}

// grad_a = g * (1 - w), grad_x = g * w, and per element of K the slope gradient g * (x - a), where an
// infinite x adds nothing (as in the PReLU's backward).
template <typename scalar_t, typename acc_t>
void blend_backward_row(const scalar_t* __restrict__ a, const scalar_t* __restrict__ x, const scalar_t* __restrict__ g,
                        const scalar_t* __restrict__ w, scalar_t* __restrict__ grad_a, scalar_t* __restrict__ grad_x,
                        acc_t* __restrict__ acc, int64_t len) {
  for (int64_t k = 0; k < len; ++k) {
    const acc_t av = a[k], xv = x[k], gv = g[k], wv = w[k];
    // -0 (adds nothing) from the branch a slope turns off, also for g = +-inf or NaN (0 * inf is NaN)
    grad_a[k] = wv == acc_t(1) ? -acc_t(0) : gv * (acc_t(1) - wv);
    grad_x[k] = wv == acc_t(0) ? -acc_t(0) : gv * wv;
    acc[k] += std::abs(xv) == std::numeric_limits<acc_t>::infinity() ? acc_t(0) : gv * (xv - av);
  }
}

// g, a, x: contiguous [N, K]; w_rep: [K]. Blocks and partial sums as fused_backward's: the slope gradient does
// not depend on the thread count.
std::tuple<Tensor, Tensor, Tensor> fused_blend_backward(const Tensor& g, const Tensor& a, const Tensor& x,
                                                        const Tensor& w_rep) {
  const int64_t K = w_rep.numel(), N = x.numel() / K;
  Tensor grad_a = at::empty_like(x), grad_x = at::empty_like(x);
  Tensor acc;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "linearize_blend_backward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const int64_t rows = std::max<int64_t>(1, 32768 / K);
    const int64_t blocks = (N + rows - 1) / rows;
    Tensor partial = at::zeros({blocks, K}, x.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
    const scalar_t* ap = a.const_data_ptr<scalar_t>();
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* gp = g.const_data_ptr<scalar_t>();
    const scalar_t* wp = w_rep.const_data_ptr<scalar_t>();
    scalar_t* gap = grad_a.mutable_data_ptr<scalar_t>();
    scalar_t* gxp = grad_x.mutable_data_ptr<scalar_t>();
    acc_t* pp = partial.mutable_data_ptr<acc_t>();
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b)
        for (int64_t n = b * rows; n < std::min(N, (b + 1) * rows); ++n)
          blend_backward_row<scalar_t, acc_t>(ap + n * K, xp + n * K, gp + n * K, wp, gap + n * K, gxp + n * K,
                                              pp + b * K, K);
    });
    acc = blocks > 1 ? partial.sum(0) : partial.view({K});
  });
  return {grad_a, grad_x, acc};
}

// The backward runs as differentiable ATen ops (same formulas) instead of the fused loops when it is itself
// differentiated (create_graph=True: keep the graph) or when the gradient has no storage for the loops to read:
// a vmap BatchedTensor, which torch.autograd.functional.jacobian(..., vectorize=True) and
// torch.autograd.grad(..., is_grads_batched=True) pass (the ATen ops take it one batch of gradients at a time).
bool ops_backward(const Tensor& grad) {
  return torch::autograd::GradMode::is_enabled() || !grad.has_storage();
}

// v.masked_fill(mask, value) differentiated as v itself: the zero a backward puts where a slope turns a branch
// off (w * g at w = 0), whose graph must keep w * g's derivatives when the backward is differentiated (a gradient
// penalty's gradient to a slope at 0 or 1 is d(w * g)/dw = g; masked_fill's would be 0).
struct FillFunction : public torch::autograd::Function<FillFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& v, const Tensor& mask, double value) {
    return v.masked_fill(mask, value);
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) { return {grads[0], Tensor(), Tensor()}; }
};

Tensor filled(const Tensor& v, const Tensor& mask, double value) {
  return torch::autograd::GradMode::is_enabled() ? FillFunction::apply(v, mask, value) : v.masked_fill(mask, value);
}

struct PReLUFunction : public torch::autograd::Function<PReLUFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& w) {
    ctx->save_for_backward({x, w});
    const int64_t s = inner_size(x);
    return fused_forward(x, repeat_slopes(w, s).contiguous());
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &x = saved[0], &w = saved[1];
    const int64_t n = x.size(0), c = w.numel(), s = inner_size(x);
    const Tensor flat_x = x.view({n, c * s});
    const Tensor flat_g = grads[0].reshape({n, c * s});
    const Tensor w_rep = repeat_slopes(w, s);
    Tensor grad_x, grad_w;
    if (ops_backward(grads[0])) {
      const Tensor neg = flat_g.masked_fill(flat_x > 0, 0);
      grad_x = at::where(flat_x <= 0, filled(flat_g * w_rep, w_rep == 0, 0), flat_g);  // 0 * inf: NaN
      grad_w = at::where(flat_x.isinf(), 0, neg * flat_x).sum(0);  // neg is 0 at +inf: 0 * inf = NaN
    } else {
      std::tie(grad_x, grad_w) = fused_backward(flat_g.contiguous(), flat_x, w_rep.contiguous());
    }
    if (s > 1) grad_w = grad_w.view({c, s}).sum(1);
    return {grad_x.view(x.sizes()), grad_w.to(w.scalar_type())};
  }
};

// Whether every slope is 0 (-0 too): a loop over the C slopes, no ATen reduction (any() and item() cost more than
// the small maps' whole backward)
bool all_zero(const Tensor& w) {
  const Tensor v = w.contiguous();
  bool zero = true;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, v.scalar_type(), "linearize_all_zero", [&] {
    const scalar_t* p = v.const_data_ptr<scalar_t>();
    for (int64_t k = 0; k < v.numel() && zero; ++k) zero = p[k] == scalar_t(0);
  });
  return zero;
}

struct BlendFunction : public torch::autograd::Function<BlendFunction> {
  // inner: how many consecutive elements share a slope (the rows are [C * inner] blocks of x's memory)
  static Tensor forward(AutogradContext* ctx, const Tensor& a, const Tensor& x, const Tensor& w, int64_t inner) {
    ctx->save_for_backward({a, x, w});
    ctx->saved_data["inner"] = inner;
    return fused_blend_forward(a, x, repeat_slopes(w, inner).contiguous());
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &a = saved[0], &x = saved[1], &w = saved[2];
    const int64_t c = w.numel(), s = ctx->saved_data["inner"].toInt(), n = x.numel() / (c * s);
    const Tensor flat_a = a.view({n, c * s}), flat_x = x.view({n, c * s});
    const Tensor flat_g = grads[0].reshape({n, c * s});
    const Tensor w_rep = repeat_slopes(w, s);
    Tensor grad_a, grad_x, grad_w;
    if (ops_backward(grads[0])) {
      grad_a = filled(flat_g * (1 - w_rep), w_rep == 1, -0.0);
      grad_x = filled(flat_g * w_rep, w_rep == 0, -0.0);
      grad_w = at::where(flat_x.isinf(), 0, flat_g * (flat_x - flat_a)).sum(0);
    } else {
      std::tie(grad_a, grad_x, grad_w) = fused_blend_backward(flat_g.contiguous(), flat_a, flat_x, w_rep.contiguous());
    }
    if (s > 1) grad_w = grad_w.view({c, s}).sum(1);
    // every slope 0 (outside a double backward): the activation gets g itself, in its own layout, as the original's
    // backward does (torch's CPU gelu/silu backward round differently on a contiguous copy of a strided gradient)
    grad_a = ops_backward(grads[0]) || !all_zero(w) ? grad_a.view(x.sizes()) : grads[0];
    return {grad_a, grad_x.view(x.sizes()), grad_w.to(w.scalar_type()), Tensor()};
  }
};

Tensor prelu(const Tensor& x, const Tensor& w) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 2 && x.is_contiguous() && x.numel() > 0,
              "linearize prelu kernel: expected a non-empty contiguous CPU tensor [N, C, ...]");
  TORCH_CHECK(w.dim() == 1 && w.numel() == x.size(1) && w.scalar_type() == x.scalar_type(),
              "linearize prelu kernel: expected slopes [C] of the input's dtype");
  return PReLUFunction::apply(x, w);
}

Tensor blend(const Tensor& a, const Tensor& x, const Tensor& w, int64_t inner) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1 && x.is_contiguous() && x.numel() > 0,
              "linearize blend kernel: expected a non-empty contiguous CPU tensor");
  TORCH_CHECK(a.device().is_cpu() && a.is_contiguous() && a.sizes() == x.sizes() && a.scalar_type() == x.scalar_type(),
              "linearize blend kernel: expected act(x) of the input's shape and dtype, contiguous");
  TORCH_CHECK(w.dim() == 1 && w.numel() > 0 && inner > 0 && x.numel() % (w.numel() * inner) == 0 &&
                  w.scalar_type() == x.scalar_type(),
              "linearize blend kernel: expected slopes [C] of the input's dtype, each for inner consecutive elements");
  return BlendFunction::apply(a, x, w, inner);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("prelu", &prelu, "PReLU with per-channel slopes (channels at dim 1), fused CPU backward");
  m.def("blend", &blend, "(1 - w) * a + w * x, each slope w[c] for inner consecutive elements in rows of C * inner, "
                        "exact at w = 0 and 1");
}

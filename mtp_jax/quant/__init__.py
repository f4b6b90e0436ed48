"""Quantized weights: the stored array (`quantized_array`), how products read each matmul weight, declared where the
model creates it (`matmul_axes`), one module per format (`int8`, `int4`, `fp8`, each with its `WeightFormat`;
activations rounded to int8: `int8_activations`), the product as stored (`blocked_product`), which weights each format
stores and the whole-model passes (`formats`, whose `STORED_FORMATS` lists the formats), and the weights as the decode
loop holds them (`loop_weights`). Adding a format: docs/adding-a-weight-format.md."""

# timeout: 200
# Issue 16: the quantized GEMV's add + RMSNorm epilogue (session 18). Llama-3-8B AWQ batch-1 decode with
# the norms in the GEMVs of o/down and with them apart (QuantizedLinearMethod.fold_norm_after), fp16 in
# the same run (the 2.5x and 0.65-of-floor targets); then the folded step kernel by kernel.
python benches/quantization.py --only engine --skip-32b 2>&1 | grep -v -i "warn"
python benches/decode_profile.py --model llama-3-8b-awq --batch 1 --context 256 --graphs 2>&1 \
  | grep -v -i "capturing\|warn" | head -40

# The tests run against the real NIF and the fixtures that scripts/setup
# builds in .cache/fixtures. Tests that need the fixtures are tagged
# :fixtures; without the fixtures they are excluded. Test modules that need
# an optional dependency (Nx, :telemetry) are compiled only where it is.
# Whatever is left out is said here, so a run never passes quietly short.
left_out =
  for {module, file, reason} <- EMLXAxon.TestSuites.left_out() do
    "  #{module} (#{file}): #{reason}"
  end

exclude =
  if EMLXAxon.TestFixtures.available?() do
    []
  else
    [:fixtures]
  end

left_out =
  if exclude == [] do
    left_out
  else
    left_out ++
      [
        "  every test tagged :fixtures: the fixtures are missing from " <>
          "#{EMLXAxon.TestFixtures.fixtures_dir()} (run scripts/setup)"
      ]
  end

if left_out == [] do
  IO.puts("Every test module runs (Nx, :telemetry and the fixtures are available).")
else
  IO.puts(:stderr, "\e[33mLeft out of this run:\n#{Enum.join(left_out, "\n")}\e[0m")
end

# MLX's CUDA backend computes float32 matmuls in TF32 unless
# MLX_ENABLE_TF32=0 (read once, at its first float32 matmul); the references
# are full float32. It does nothing on the CPU.
if System.get_env("MLX_ENABLE_TF32") in [nil, ""], do: System.put_env("MLX_ENABLE_TF32", "0")

# On a GPU, MLX compiles its kernels on first use: do it here, not in
# whichever test comes first.
if exclude == [], do: EMLXAxon.TestFixtures.warm_up()

# Shapes the warm-up did not cover still compile in their test, a minute at
# worst while other tests compile too.
timeout = if EMLXAxon.TestFixtures.gpu?(), do: 180_000, else: 60_000

ExUnit.start(exclude: exclude, timeout: timeout)

# The tests run against the real NIF and the fixtures that scripts/setup
# builds in .cache/fixtures. Tests that need the fixtures are tagged
# :fixtures; without the fixtures they are excluded, as are tests tagged
# with what else this machine lacks (EMLXAxon.TestSuites.excluded_tags/0).
# Test modules that need an optional dependency (Nx, :telemetry) are
# compiled only where it is.
# Whatever is left out is said here, so a run never passes quietly short.
left_out =
  for {module, file, reason} <- EMLXAxon.TestSuites.left_out() do
    "  #{module} (#{file}): #{reason}"
  end

# Where Nx (and :telemetry) are on the code path without being this
# project's dependencies (ERL_LIBS), their applications are not started.
for app <- [:telemetry, :nx], :code.lib_dir(app) != {:error, :bad_name} do
  {:ok, _} = Application.ensure_all_started(app)
end

fixtures? = EMLXAxon.TestFixtures.available?()

missing =
  if fixtures? do
    []
  else
    [
      {:fixtures,
       "the fixtures are missing from #{EMLXAxon.TestFixtures.fixtures_dir()} (run scripts/setup)"}
    ]
  end ++ EMLXAxon.TestSuites.excluded_tags()

exclude = Enum.map(missing, &elem(&1, 0))

left_out =
  left_out ++ for {tag, reason} <- missing, do: "  every test tagged #{inspect(tag)}: #{reason}"

if left_out == [] do
  IO.puts(
    "Every test module runs (Nx, :telemetry, the fixtures and scripts/setup's .venv are available)."
  )
else
  IO.puts(:stderr, "\e[33mLeft out of this run:\n#{Enum.join(left_out, "\n")}\e[0m")
end

# MLX's CUDA backend computes float32 matmuls in TF32 unless
# MLX_ENABLE_TF32=0 (read once, at its first float32 matmul); the references
# are full float32. It does nothing on the CPU.
if System.get_env("MLX_ENABLE_TF32") in [nil, ""], do: System.put_env("MLX_ENABLE_TF32", "0")

# On a GPU, MLX compiles its kernels on first use: do it here, not in
# whichever test comes first.
if fixtures?, do: EMLXAxon.TestFixtures.warm_up()

# Shapes the warm-up did not cover still compile in their test, a minute at
# worst while other tests compile too.
timeout = if EMLXAxon.TestFixtures.gpu?(), do: 180_000, else: 60_000

ExUnit.start(exclude: exclude, timeout: timeout)

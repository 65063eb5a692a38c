defmodule EMLXAxon.TestMemory do
  @moduledoc false
  # Memory figures for the leak tests: MLX's own count of live array bytes
  # (exact, so a single leaked array shows) and the OS process's RSS (for
  # everything MLX does not count).

  @doc "Bytes held by live MLX arrays."
  def active, do: EMLXAxon.memory_info().active

  @doc "Resident set size of this OS process, in bytes (Linux)."
  def rss do
    [kb] =
      Regex.run(~r/VmRSS:\s+(\d+) kB/, File.read!("/proc/self/status"), capture: :all_but_first)

    String.to_integer(kb) * 1024
  end

  @doc "Collects every process, so that dropped resources run their destructors."
  def collect_all do
    for pid <- Process.list(), do: :erlang.garbage_collect(pid)
    :ok
  end

  @doc """
  MLX's active memory once it stops changing. A generation that finishes
  (or is freed) may still have its next step queued on its stream, as
  decoding runs a step ahead; that step's buffers go when it completes.
  MLX's stream thread also releases a step's small temporaries after its
  results are read, so a reading can include a few bytes that go later:
  leak checks compare with `<=` (no growth), not equality.
  """
  def settled_active do
    collect_all()
    settle(active(), 200)
  end

  defp settle(previous, 0), do: previous

  defp settle(previous, tries) do
    Process.sleep(25)

    case active() do
      ^previous -> previous
      current -> settle(current, tries - 1)
    end
  end

  @doc """
  Waits up to `ms` for MLX's active memory to come back to `expected` or
  below, collecting every process meanwhile unless `collect: false`;
  returns the last figure read.
  """
  def await_active(expected, ms \\ 5_000, opts \\ []) do
    deadline = System.monotonic_time(:millisecond) + ms
    await_active(expected, deadline, Keyword.get(opts, :collect, true), active())
  end

  defp await_active(expected, deadline, collect?, current) do
    if current <= expected or System.monotonic_time(:millisecond) > deadline do
      current
    else
      Process.sleep(10)
      if collect?, do: collect_all()
      await_active(expected, deadline, collect?, active())
    end
  end

  @doc """
  KV cache bytes of a generation of `batch` rows and `positions` positions,
  in the cache's default dtype: float16 under a float32 model on the CPU,
  the model's elsewhere.
  """
  def kv_bytes(%{config: c}, batch, positions) do
    element = if c.dtype == "float32" and EMLXAxon.TestFixtures.gpu?(), do: 4, else: 2
    2 * c.num_layers * batch * c.num_kv_heads * positions * c.head_dim * element
  end

  @doc "Growth from `before` to `later`, in percent."
  def growth(before, later), do: (later - before) / before * 100

  def mb(bytes), do: "#{Float.round(bytes / 1_048_576, 1)} MB"
end

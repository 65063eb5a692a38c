defmodule EMLXAxon.MixNative.Backend do
  @moduledoc false
  # Which MLX backend the native part is built for: the `EMLX_AXON_BACKEND`
  # variable, else `config :emlx_axon, backend: ...`, else Metal on macOS and
  # the CPU elsewhere. The backend is the libmlx wheel linked; Metal also
  # needs a cargo feature.

  @backends [:cpu, :cuda, :metal]

  # What scripts/setup installs for each backend (MLX_BACKEND=...).
  @wheels %{cpu: "mlx-cpu", cuda: "mlx-cuda-13", metal: "mlx-metal"}

  def backends, do: @backends

  @doc false
  # The backend asked for, or nil.
  def requested! do
    {value, source} =
      case System.get_env("EMLX_AXON_BACKEND") do
        env when env not in [nil, ""] -> {env, "EMLX_AXON_BACKEND"}
        _ -> {Application.get_env(:emlx_axon, :backend), "config :emlx_axon, :backend"}
      end

    if value in [nil, ""], do: nil, else: parse!(value, source)
  end

  @doc false
  def default do
    if match?({:unix, :darwin}, :os.type()), do: :metal, else: :cpu
  end

  defp parse!(value, source) do
    case Enum.find(@backends, &(to_string(&1) == to_string(value))) do
      nil ->
        Mix.raise(
          "#{source} is #{inspect(value)}; the MLX backend must be one of " <>
            Enum.map_join(@backends, ", ", &inspect/1)
        )

      backend ->
        backend
    end
  end

  def cargo_features(:metal), do: ["--features", "metal"]
  def cargo_features(_cpu_or_cuda), do: []

  def wheel(backend), do: Map.fetch!(@wheels, backend)

  @doc false
  # The backend of the wheel an MLX prefix (the `mlx` package folder) comes
  # from, read from the wheels installed beside it; nil when it is not a
  # wheel install (an MLX built from source, say).
  def of_prefix(prefix) do
    site = Path.dirname(prefix)

    Enum.find(@backends, fn backend ->
      dist = String.replace(wheel(backend), "-", "_")
      Path.wildcard(Path.join(site, "#{dist}-*.dist-info")) != []
    end)
  end

  @doc false
  # The backend a source build is for: the one asked for, which must be the
  # one of the MLX found, else that one.
  def for_prefix!(nil, prefix), do: of_prefix(prefix) || default()

  def for_prefix!(requested, prefix) do
    case of_prefix(prefix) do
      found when found in [nil, requested] ->
        requested

      found ->
        Mix.raise("""
        the MLX backend #{inspect(requested)} was asked for (EMLX_AXON_BACKEND or \
        config :emlx_axon, :backend), but the MLX that cargo built against, #{prefix}, \
        is the #{wheel(found)} wheel (#{inspect(found)}).

        To fix it, either:
          * install the #{wheel(requested)} wheel: MLX_BACKEND=#{requested} scripts/setup \
        (from the emlx_axon directory), then `mix compile` again;
          * or point MLX_PREFIX at an installed #{wheel(requested)} `mlx` package folder;
          * or ask for the backend you have: EMLX_AXON_BACKEND=#{found}.
        """)
    end
  end
end

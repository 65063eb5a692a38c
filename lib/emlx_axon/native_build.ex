defmodule EMLXAxon.NativeBuild do
  @moduledoc false
  # What priv/native/ holds, as the Mix compiler recorded it when it built or
  # installed it (emlx_axon_nif.info), and whether that suits this machine
  # and the backend asked for at run time. Checked before the NIF is loaded,
  # so a mismatch is an error that says what to do rather than an MLX failure.

  @info "emlx_axon_nif.info"
  @backends [:cpu, :cuda, :metal]

  @spec read(Path.t()) :: {:ok, map()} | :error
  def read(native_dir) do
    case :file.consult(String.to_charlist(Path.join(native_dir, @info))) do
      {:ok, [%{backend: backend} = info]} when backend in @backends -> {:ok, info}
      _ -> :error
    end
  end

  @spec check(map()) :: :ok | {:error, String.t()}
  def check(%{backend: built}) do
    with :ok <- check_requested(built, requested()), do: check_machine(built)
  end

  # The backend asked for at run time: EMLX_AXON_BACKEND, else the
  # application's `:backend` (the same settings that choose the build).
  defp requested do
    case System.get_env("EMLX_AXON_BACKEND") do
      env when env not in [nil, ""] -> {env, "EMLX_AXON_BACKEND"}
      _ -> {Application.get_env(:emlx_axon, :backend), "config :emlx_axon, :backend"}
    end
  end

  defp check_requested(_built, {nil, _source}), do: :ok

  defp check_requested(built, {value, source}) do
    case Enum.find(@backends, &(to_string(&1) == to_string(value))) do
      ^built ->
        :ok

      nil ->
        {:error,
         "#{source} is #{inspect(value)}; the MLX backend must be one of :cpu, :cuda, :metal"}

      requested ->
        {:error,
         """
         this emlx_axon native part was built for the #{inspect(built)} MLX backend, \
         but #{source} asks for #{inspect(requested)}.

         To fix it, rebuild it for #{inspect(requested)} (with EMLX_AXON_BACKEND=#{requested} \
         set, `mix deps.compile emlx_axon --force` in your application, or `mix compile \
         --force` in emlx_axon), or ask for the backend it has (#{inspect(built)}).\
         """}
    end
  end

  defp check_machine(:cuda) do
    if File.exists?("/proc/driver/nvidia/version") do
      :ok
    else
      {:error,
       """
       this emlx_axon native part is built for the CUDA MLX backend, but this machine has \
       no NVIDIA driver (/proc/driver/nvidia/version does not exist), so MLX cannot run.

       To fix it, run on a machine with an NVIDIA GPU and driver, or use the CPU backend: \
       rebuild with EMLX_AXON_BACKEND=cpu (`mix deps.compile emlx_axon --force`) or \
       install the cpu precompiled artifact.\
       """}
    end
  end

  defp check_machine(:metal) do
    if match?({:unix, :darwin}, :os.type()) do
      :ok
    else
      {:error,
       "this emlx_axon native part is built for the Metal MLX backend, which runs on " <>
         "macOS only; rebuild with EMLX_AXON_BACKEND=cpu (or cuda) on this machine"}
    end
  end

  defp check_machine(:cpu), do: :ok

  @doc false
  # Why a library the NIF links may be missing, for the load error.
  @spec load_hint(map() | nil) :: String.t()
  def load_hint(%{backend: backend, system_libraries: [_ | _] = libraries} = info) do
    packages =
      case Map.get(info, :system_packages, []) do
        [] -> "the CUDA toolkit and cuDNN/NCCL"
        packages -> "pip install " <> Enum.map_join(packages, " ", &"'#{&1}'")
      end

    "\n\nThe #{backend} MLX links #{Enum.join(libraries, ", ")}, which emlx_axon does not " <>
      "bundle (libcuda comes with the NVIDIA driver). Install the others (#{packages}) and " <>
      "put their lib/ folders on LD_LIBRARY_PATH."
  end

  def load_hint(_info), do: ""
end

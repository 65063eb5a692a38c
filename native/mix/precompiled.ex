defmodule EMLXAxon.MixNative.Precompiled do
  @moduledoc false
  # Installs a precompiled native part (made by `mix emlx_axon.precompile`)
  # instead of building it: no Rust, no Python, no MLX install needed.
  #
  # `EMLX_AXON_PRECOMPILED` (or `config :emlx_axon, precompiled: ...`) is a
  # base URL (http or https) or a local folder holding the artifacts. The
  # sha256 each artifact must have comes from checksum-emlx_axon.exs in this
  # library (not from where the artifact is downloaded), so a tampered or
  # truncated download is refused.

  alias EMLXAxon.MixNative.Bundle

  @checksum_file "checksum-emlx_axon.exs"
  @timeout 120_000

  def checksum_file, do: @checksum_file

  @doc false
  # The configured source, or nil to build from source.
  def source do
    case System.get_env("EMLX_AXON_PRECOMPILED") do
      env when env not in [nil, ""] -> env
      _ -> Application.get_env(:emlx_axon, :precompiled)
    end
  end

  @doc false
  # The artifact's name and sha256 for this version, target and backend.
  def artifact!(root, version, backend) do
    target = Bundle.target()
    name = Bundle.artifact_name(version, target, backend)
    checksums = read_checksums!(root)

    case Map.fetch(checksums, name) do
      {:ok, "sha256:" <> sha} ->
        {name, String.downcase(sha)}

      _ ->
        listed = checksums |> Map.keys() |> Enum.sort() |> Enum.map_join("\n", &"    #{&1}")

        Mix.raise("""
        there is no precompiled emlx_axon #{version} for target #{target} and backend \
        #{inspect(backend)}: #{name} is not listed in #{Path.join(root, @checksum_file)}, \
        which lists:
        #{if listed == "", do: "    (nothing)", else: listed}

        To fix it, either:
          * build the native part from source: unset EMLX_AXON_PRECOMPILED (and \
        config :emlx_axon, :precompiled), install Rust and run scripts/setup from the \
        emlx_axon directory;
          * or choose a listed backend with EMLX_AXON_BACKEND (config :emlx_axon, :backend).
        """)
    end
  end

  defp read_checksums!(root) do
    path = Path.join(root, @checksum_file)

    unless File.regular?(path) do
      Mix.raise("""
      EMLX_AXON_PRECOMPILED is set, but #{path} does not exist: it lists the sha256 \
      of each precompiled artifact this version of emlx_axon accepts.

      To fix it, unset EMLX_AXON_PRECOMPILED to build from source, or make the \
      artifacts and that file with `mix emlx_axon.precompile` in the emlx_axon directory.
      """)
    end

    case Code.eval_file(path) do
      {map, _binding} when is_map(map) -> map
      _ -> Mix.raise("#{path} must hold a map of artifact names to \"sha256:...\"")
    end
  end

  @doc false
  # Downloads (or reads) the artifact, checks its sha256 and unpacks it into
  # native_dir, replacing what was there.
  def install!(source, {name, sha}, native_dir) do
    location = location(source, name)
    Mix.shell().info("Installing the precompiled emlx_axon native part from #{location}")
    tarball = fetch!(source, name, location)
    actual = Bundle.sha256(tarball)

    if actual != sha do
      Mix.raise("""
      the precompiled emlx_axon artifact from #{location} has sha256 #{actual}, but \
      #{@checksum_file} expects #{sha}: the download is damaged or is not the artifact \
      this version of emlx_axon was released with, so it was not installed.

      To fix it, check that EMLX_AXON_PRECOMPILED (#{source}) serves the artifacts of \
      this version, or unset it to build from source (Rust and scripts/setup).
      """)
    end

    unpack!(tarball, native_dir, location)
  end

  defp location(source, name) do
    if url?(source),
      do: String.trim_trailing(source, "/") <> "/" <> name,
      else: Path.join(Path.expand(source), name)
  end

  defp url?(source), do: String.starts_with?(source, ["http://", "https://"])

  defp fetch!(source, name, location) do
    if url?(source) do
      download!(location, name)
    else
      case File.read(location) do
        {:ok, binary} ->
          binary

        {:error, reason} ->
          Mix.raise("""
          could not read the precompiled emlx_axon artifact #{location}: \
          #{:file.format_error(reason)}.

          To fix it, put #{name} (made by `mix emlx_axon.precompile`) in #{source}, point \
          EMLX_AXON_PRECOMPILED at the folder or URL that has it, or unset it to build \
          from source.
          """)
      end
    end
  end

  defp download!(url, name) do
    ensure_started!([:inets, :ssl, :public_key, :crypto])

    http_options = [timeout: @timeout, connect_timeout: 15_000, ssl: ssl_options(url)]

    case :httpc.request(:get, {String.to_charlist(url), []}, http_options, body_format: :binary) do
      {:ok, {{_, 200, _}, _headers, body}} ->
        body

      {:ok, {{_, status, reason}, _headers, _body}} ->
        Mix.raise("""
        could not download the precompiled emlx_axon artifact #{url}: the server answered \
        #{status} #{reason}#{if status == 404, do: " (it has no #{name})", else: ""}.

        To fix it, point EMLX_AXON_PRECOMPILED at a place that has the artifacts of this \
        version and target, or unset it to build from source (Rust and scripts/setup).
        """)

      {:error, reason} ->
        Mix.raise("""
        could not download the precompiled emlx_axon artifact #{url}: #{inspect(reason)}.

        To fix it, check the network and the URL in EMLX_AXON_PRECOMPILED, download the \
        artifact by hand into a folder and point EMLX_AXON_PRECOMPILED at that folder, \
        or unset it to build from source (Rust and scripts/setup).
        """)
    end
  end

  # Verifies the server's certificate and host name against the operating
  # system's CA store (OTP 25+), with no extra packages.
  defp ssl_options("https://" <> _) do
    [
      verify: :verify_peer,
      cacerts: :public_key.cacerts_get(),
      depth: 4,
      customize_hostname_check: [
        match_fun: :public_key.pkix_verify_hostname_match_fun(:https)
      ]
    ]
  end

  defp ssl_options(_http), do: []

  defp ensure_started!(apps) do
    for app <- apps do
      # Elixir 1.15+ leaves OTP applications a project does not list off the
      # code path while compiling; this puts them back.
      if function_exported?(Mix, :ensure_application!, 1),
        do: apply(Mix, :ensure_application!, [app])

      {:ok, _} = Application.ensure_all_started(app)
    end
  end

  defp unpack!(tarball, native_dir, location) do
    parent = Path.dirname(native_dir)
    staging = Path.join(parent, ".native.#{System.unique_integer([:positive])}.tmp")
    old = staging <> ".old"
    File.mkdir_p!(staging)

    try do
      case :erl_tar.extract({:binary, tarball}, [:compressed, {:cwd, String.to_charlist(staging)}]) do
        :ok -> :ok
        {:error, reason} -> Mix.raise("could not unpack #{location}: #{inspect(reason)}")
      end

      unless Bundle.complete?(staging) do
        Mix.raise("#{location} is not an emlx_axon native artifact (no NIF, libmlx or info)")
      end

      if File.exists?(native_dir), do: File.rename!(native_dir, old)
      File.rename!(staging, native_dir)
      :ok
    after
      File.rm_rf(staging)
      File.rm_rf(old)
    end
  end
end

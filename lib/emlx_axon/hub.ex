defmodule EMLXAxon.Hub do
  @moduledoc """
  Checkpoints from the Hugging Face Hub, named as Bumblebee names them:
  `{:hf, "mlx-community/Qwen3-0.6B-4bit"}` or `{:hf, repo, options}`.

  Everything that takes a checkpoint folder takes such a tuple too:
  `EMLXAxon.Qwen3.Loader.load/2`, `EMLXAxon.Tokenizer.load/1`,
  `EMLXAxon.TextGeneration.from_mlx4bit/3` (and its tokenizer argument),
  `mix emlx_axon.generate --model hf:REPO`. The files are downloaded into a
  cache once and loaded from there.

      {:ok, state} = EMLXAxon.Qwen3.Loader.load({:hf, "mlx-community/Qwen3-0.6B-4bit"})
      {:ok, tokenizer} = EMLXAxon.Tokenizer.load({:hf, "mlx-community/Qwen3-0.6B-4bit"})

      {:ok, dir} = EMLXAxon.Hub.fetch({:hf, "mlx-community/Qwen3-0.6B-4bit", revision: "main"})

  ## Options

    * `:revision` - a branch, tag or commit (default `"main"`)
    * `:cache_dir` - where downloads are kept (default: `cache_dir/0`)
    * `:offline` - use only what the cache holds, with no network access
      (default: `true` when the environment variable `HF_HUB_OFFLINE` is
      `1`, else `false`)
    * `:auth_token` - a Hugging Face access token, sent as a bearer token,
      for private and gated repositories (default: `HF_TOKEN`)
    * `:endpoint` - the Hub's base URL (default: `HF_ENDPOINT`, else
      `https://huggingface.co`)
    * `:subdir` - the folder of the repository that holds the checkpoint
      (default: its root)
    * `:progress` - a function of one argument, called as a file downloads
      with `%{repo: repo, revision: rev, file: file, bytes: done, total: size}`
      (`total` is `nil` when unknown)

  ## What is downloaded

  For a checkpoint: `config.json`, the weights (the shards
  `model.safetensors.index.json` names, else every `model*.safetensors`)
  and, where the repository has them, `tokenizer.json`,
  `tokenizer_config.json`, `generation_config.json`,
  `special_tokens_map.json` and `chat_template.jinja`. For a tokenizer
  alone, the same files without the configuration and weights.

  ## The cache

  Files are kept in `cache_dir/0` (`EMLX_AXON_CACHE_DIR`, else
  `$XDG_CACHE_HOME/emlx_axon`, else `~/.cache/emlx_axon`) in
  huggingface_hub's layout: `models--ORG--NAME/blobs/` holds each file once,
  named by its ETag, and `snapshots/COMMIT/` links to them, so
  `fetch/2` returns that snapshot folder. A file already in the cache is
  not downloaded again: the repository's file list (one request, which
  gives every file's ETag) is all it costs. Offline, and when the Hub
  cannot be reached, the revision's last snapshot is used.

  A download goes to a `.part` file and is checked before it gets its
  name: its size, and its sha256 (large files, which the Hub lists with
  their sha256) or git blob id (other files). A dropped connection is
  resumed where it stopped (an HTTP `Range` request), also in a later call.
  Certificates are verified against the operating system's store
  (Erlang/OTP 25 or later).

  ## Errors

  Failures are `{:error, %EMLXAxon.Error{}}` naming the repository and the
  file, of kind `:not_found` (a repository, revision or file the Hub does
  not have: 404), `:unauthorized` (401 or 403: a private or gated
  repository, without a token or with one that cannot read it),
  `:checksum` (the download did not match its size or hash; nothing is
  kept), `:network` (the Hub could not be reached, or the connection kept
  dropping), `:offline` (offline, and the cache does not hold the files)
  or `:io`. Bad options raise `ArgumentError`.

  ## Telemetry

  See `EMLXAxon.Telemetry`: `[:emlx_axon, :hub, :fetch]` spans a fetch,
  `[:emlx_axon, :hub, :download]` each file downloaded, with
  `[:emlx_axon, :hub, :download, :progress]` events as it goes. Each
  downloaded file is also logged (Logger, `:info`).
  """

  require Logger

  alias EMLXAxon.{Error, Telemetry}
  alias EMLXAxon.Hub.{Cache, Download, HTTP}

  @default_endpoint "https://huggingface.co"
  @option_names [:revision, :cache_dir, :offline, :auth_token, :endpoint, :subdir, :progress]

  @tokenizer_files ~w(tokenizer.json tokenizer_config.json generation_config.json
                      special_tokens_map.json chat_template.jinja)
  @index "model.safetensors.index.json"

  @typedoc """
  A Hugging Face Hub repository: `{:hf, "org/name"}` or
  `{:hf, "org/name", options}` (see the module documentation).
  """
  @type repository :: {:hf, String.t()} | {:hf, String.t(), keyword()}

  @typedoc "What to fetch: a whole checkpoint, or only its tokenizer's files."
  @type what :: :checkpoint | :tokenizer

  @doc """
  Downloads a checkpoint (or, with `:tokenizer`, only its tokenizer's
  files) into the cache, or finds it there, and returns its local folder.

  ## Examples

      {:ok, dir} = EMLXAxon.Hub.fetch({:hf, "mlx-community/Qwen3-0.6B-4bit"})
      {:ok, dir} = EMLXAxon.Hub.fetch({:hf, "Qwen/Qwen3-0.6B", revision: "main"}, :tokenizer)

      {:error, %EMLXAxon.Error{kind: :offline}} =
        EMLXAxon.Hub.fetch({:hf, "mlx-community/never-fetched", offline: true})

  """
  @spec fetch(repository(), what()) :: {:ok, Path.t()} | {:error, Error.t()}
  def fetch(repository, what \\ :checkpoint) do
    ctx = context!(repository)

    unless what in [:checkpoint, :tokenizer] do
      raise ArgumentError,
            "expected what to fetch to be :checkpoint or :tokenizer, got: #{inspect(what)}"
    end

    Telemetry.span([:emlx_axon, :hub, :fetch], %{repo: ctx.repo, revision: ctx.revision}, fn ->
      result =
        if ctx.offline do
          from_cache(ctx, what, "offline")
        else
          online(ctx, what)
        end

      case result do
        {:ok, dir} -> {result, %{}, %{path: dir}}
        {:error, error} -> {result, %{}, %{error: error}}
      end
    end)
  end

  @doc """
  Like `fetch/2`, but returns the folder or raises `EMLXAxon.Error`.

  ## Examples

      dir = EMLXAxon.Hub.fetch!({:hf, "mlx-community/Qwen3-0.6B-4bit"})

  """
  @spec fetch!(repository(), what()) :: Path.t()
  def fetch!(repository, what \\ :checkpoint) do
    case fetch(repository, what) do
      {:ok, dir} -> dir
      {:error, error} -> raise error
    end
  end

  @doc """
  The cache folder used when no `:cache_dir` is given: `EMLX_AXON_CACHE_DIR`,
  else `$XDG_CACHE_HOME/emlx_axon`, else `~/.cache/emlx_axon`.

  ## Examples

      EMLXAxon.Hub.cache_dir()
      #=> "/home/me/.cache/emlx_axon"

  """
  @spec cache_dir() :: Path.t()
  def cache_dir, do: Cache.default_dir()

  @doc false
  # True for the tuples this module fetches.
  @spec repository?(term()) :: boolean()
  def repository?({:hf, repo}) when is_binary(repo), do: true
  def repository?({:hf, repo, opts}) when is_binary(repo) and is_list(opts), do: true
  def repository?(_), do: false

  ## Options

  defp context!({:hf, repo}), do: context!({:hf, repo, []})

  defp context!({:hf, repo, opts}) when is_list(opts) do
    repo!(repo)

    unless Keyword.keyword?(opts) do
      raise ArgumentError,
            "expected the options of {:hf, #{inspect(repo)}, options} to be a keyword list, " <>
              "got: #{inspect(opts)}"
    end

    for {key, value} <- opts, do: option!(key, value)

    endpoint =
      (opts[:endpoint] || env("HF_ENDPOINT") || @default_endpoint)
      |> String.trim_trailing("/")

    endpoint!(endpoint, if(opts[:endpoint], do: ":endpoint", else: "HF_ENDPOINT"))
    cache_dir = Path.expand(opts[:cache_dir] || Cache.default_dir())

    offline =
      case Keyword.fetch(opts, :offline) do
        {:ok, offline} when is_boolean(offline) -> offline
        _ -> String.downcase(env("HF_HUB_OFFLINE") || "") in ["1", "true", "yes", "on"]
      end

    %{
      repo: repo,
      revision: opts[:revision] || "main",
      subdir: opts[:subdir] && String.trim(opts[:subdir], "/"),
      commit: nil,
      endpoint: endpoint,
      token: Keyword.get_lazy(opts, :auth_token, fn -> env("HF_TOKEN") end),
      cache_dir: cache_dir,
      repo_dir: Cache.repo_dir(cache_dir, repo),
      offline: offline,
      progress: opts[:progress],
      idle_timeout: 60_000,
      version: version()
    }
  end

  defp context!(other) do
    raise ArgumentError,
          "expected a Hugging Face repository as {:hf, \"org/name\"} or {:hf, \"org/name\", " <>
            "options}, got: #{inspect(other)}"
  end

  defp repo!(repo) do
    valid? =
      is_binary(repo) and repo =~ ~r/\A[A-Za-z0-9][\w.-]*(\/[A-Za-z0-9][\w.-]*)?\z/ and
        not String.contains?(repo, ["..", "--"])

    unless valid? do
      raise ArgumentError,
            "expected a Hugging Face repository id such as \"mlx-community/Qwen3-0.6B-4bit\", " <>
              "got: #{inspect(repo)}"
    end
  end

  defp option!(:revision, value) do
    unless is_binary(value) and relative_path?(value) do
      raise ArgumentError,
            "expected :revision to be a branch, tag or commit name, got: #{inspect(value)}"
    end
  end

  defp option!(:subdir, nil), do: :ok

  defp option!(:subdir, value) do
    unless is_binary(value) and relative_path?(String.trim(value, "/")) do
      raise ArgumentError,
            "expected :subdir to be a folder of the repository, got: #{inspect(value)}"
    end
  end

  defp option!(key, value) when key in [:cache_dir, :endpoint] do
    unless is_binary(value) and value != "" do
      raise ArgumentError, "expected #{inspect(key)} to be a string, got: #{inspect(value)}"
    end
  end

  defp option!(:offline, value) do
    unless is_boolean(value),
      do: raise(ArgumentError, "expected :offline to be a boolean, got: #{inspect(value)}")
  end

  defp option!(:auth_token, value) do
    unless value == nil or (is_binary(value) and value != "") do
      raise ArgumentError,
            "expected :auth_token to be a string (a Hugging Face access token), got: " <>
              inspect(value)
    end
  end

  defp option!(:progress, value) do
    unless value == nil or is_function(value, 1) do
      raise ArgumentError,
            "expected :progress to be a function of one argument, got: #{inspect(value)}"
    end
  end

  defp option!(key, _value) do
    raise ArgumentError,
          "unknown option #{inspect(key)} for a Hugging Face repository, valid options are: " <>
            Enum.map_join(@option_names, ", ", &inspect/1)
  end

  defp endpoint!(endpoint, source) do
    uri = URI.parse(endpoint)

    unless uri.scheme in ["http", "https"] and is_binary(uri.host) and uri.host != "" do
      raise ArgumentError,
            "expected #{source} to be an http or https URL, got: #{inspect(endpoint)}"
    end
  end

  defp relative_path?(path) do
    path != "" and not String.starts_with?(path, "/") and
      not String.contains?(path, ["\\", <<0>>]) and
      Enum.all?(String.split(path, "/"), &(&1 not in ["", ".", ".."]))
  end

  defp env(name) do
    case System.get_env(name) do
      value when value in [nil, ""] -> nil
      value -> value
    end
  end

  defp version do
    case Application.spec(:emlx_axon, :vsn) do
      nil -> "dev"
      vsn -> to_string(vsn)
    end
  end

  ## Online

  defp online(ctx, what) do
    with :ok <- started(ctx),
         {:ok, commit, siblings} <- listing(ctx) do
      ctx = %{ctx | commit: commit}
      snapshot = Cache.snapshot_dir(ctx.repo_dir, commit)

      with :ok <- fetch_files(ctx, snapshot, siblings, first_files(what, siblings, ctx)),
           {:ok, weights} <- weights(ctx, what, snapshot, siblings),
           :ok <- fetch_files(ctx, snapshot, siblings, weights),
           :ok <- write_ref(ctx, commit) do
        {:ok, in_subdir(ctx, snapshot)}
      end
    else
      {:error, %Error{kind: :network} = error} -> cached_instead(ctx, what, error)
      {:error, _} = error -> error
    end
  end

  # When the Hub cannot be reached, a snapshot of the revision in the cache
  # will do, as with huggingface_hub.
  defp cached_instead(ctx, what, error) do
    case from_cache(ctx, what, "unreachable") do
      {:ok, dir} ->
        Logger.warning(
          "The Hugging Face Hub could not be reached (#{error.message}); " <>
            "using the cached #{ctx.repo} (revision #{ctx.revision}) in #{dir}"
        )

        {:ok, dir}

      {:error, _} ->
        {:error, error}
    end
  end

  defp started(ctx) do
    case HTTP.ensure_started(ctx.endpoint) do
      :ok ->
        :ok

      {:error, message} ->
        {:error,
         Error.exception(
           kind: :network,
           message: "cannot download the Hugging Face repository #{ctx.repo}: #{message}"
         )}
    end
  end

  defp listing(ctx) do
    url =
      "#{ctx.endpoint}/api/models/#{ctx.repo}/revision/#{Download.encode(ctx.revision)}?blobs=true"

    case HTTP.request(:get, url, Download.auth_headers(ctx)) do
      {:ok, 200, _headers, body} ->
        parse_listing(ctx, url, body)

      {:ok, status, headers, body} ->
        {:error, Download.status_error(ctx, nil, url, status, headers, body)}

      {:error, reason} ->
        {:error, Download.network_error(ctx, nil, url, reason, 1)}
    end
  end

  defp parse_listing(ctx, url, body) do
    with {:ok, %{"sha" => commit, "siblings" => siblings}}
         when is_binary(commit) and is_list(siblings) <- EMLXAxon.JSON.Decoder.decode(body),
         true <- commit =~ ~r/\A[0-9a-f]{40}\z/ do
      siblings =
        for %{"rfilename" => name} = sibling when is_binary(name) <- siblings, into: %{} do
          lfs = if is_map(sibling["lfs"]), do: sibling["lfs"], else: %{}
          sha256 = string_or_nil(lfs["sha256"])
          size = integer_or_nil(lfs["size"]) || integer_or_nil(sibling["size"])
          blob_id = string_or_nil(sibling["blobId"])
          {name, %{size: size, sha256: sha256, blob_id: blob_id, etag: sha256 || blob_id}}
        end

      {:ok, commit, siblings}
    else
      _ ->
        {:error,
         Error.exception(
           kind: :network,
           message:
             "the file list of the Hugging Face repository #{ctx.repo} (revision " <>
               "#{ctx.revision}) from #{url} is not what the Hub answers (no commit or files)"
         )}
    end
  end

  defp string_or_nil(value) when is_binary(value) and value != "", do: value
  defp string_or_nil(_), do: nil
  defp integer_or_nil(value) when is_integer(value) and value >= 0, do: value
  defp integer_or_nil(_), do: nil

  # The files to fetch before the weights: those that must be there
  # (requested even when unlisted, so the Hub's answer names what is
  # missing) and the optional ones the repository lists.
  defp first_files(what, siblings, ctx) do
    {required, optional} =
      case what do
        :tokenizer -> {["tokenizer.json"], @tokenizer_files -- ["tokenizer.json"]}
        :checkpoint -> {["config.json"], [@index | @tokenizer_files]}
      end

    required = Enum.map(required, &repo_path(ctx, &1))

    optional =
      for name <- optional, path = repo_path(ctx, name), Map.has_key?(siblings, path), do: path

    required ++ optional
  end

  defp weights(_ctx, :tokenizer, _snapshot, _siblings), do: {:ok, []}

  defp weights(ctx, :checkpoint, snapshot, siblings) do
    index = repo_path(ctx, @index)

    if Map.has_key?(siblings, index) do
      shards_of_index(ctx, Path.join(snapshot, index))
    else
      prefix = if ctx.subdir, do: ctx.subdir <> "/", else: ""

      listed =
        for name <- Map.keys(siblings),
            String.starts_with?(name, prefix),
            base = String.replace_prefix(name, prefix, ""),
            not String.contains?(base, "/"),
            String.starts_with?(base, "model") and String.ends_with?(base, ".safetensors"),
            do: name

      if listed == [] do
        {:error,
         Error.exception(
           kind: :not_found,
           message:
             "the Hugging Face repository #{ctx.repo} (revision #{ctx.revision}) has no " <>
               "#{repo_path(ctx, "model*.safetensors")} weights (nor #{index})"
         )}
      else
        {:ok, Enum.sort(listed)}
      end
    end
  end

  defp shards_of_index(ctx, path) do
    with {:ok, text} <- File.read(path),
         {:ok, %{"weight_map" => map}} when is_map(map) <- EMLXAxon.JSON.Decoder.decode(text),
         shards = map |> Map.values() |> Enum.uniq() |> Enum.sort(),
         true <- shards != [] and Enum.all?(shards, &(is_binary(&1) and relative_path?(&1))) do
      {:ok, Enum.map(shards, &repo_path(ctx, &1))}
    else
      _ ->
        {:error,
         Error.exception(
           kind: :json,
           message:
             "#{@index} of the Hugging Face repository #{ctx.repo} (revision " <>
               "#{ctx.revision}) has no usable weight_map (shard file names in the repository)"
         )}
    end
  end

  defp fetch_files(ctx, snapshot, siblings, files) do
    Enum.reduce_while(files, :ok, fn file, :ok ->
      with {:ok, blob, _status} <- Download.fetch(ctx, file, siblings[file]),
           :ok <- link(ctx, file, blob, Path.join(snapshot, file)) do
        {:cont, :ok}
      else
        {:error, _} = error -> {:halt, error}
      end
    end)
  end

  defp link(ctx, file, blob, path) do
    io_result(
      Cache.link(blob, path),
      "could not put #{file} of the Hugging Face repository #{ctx.repo} in the cache at #{path}"
    )
  end

  defp write_ref(%{revision: commit, commit: commit}, commit), do: :ok

  defp write_ref(ctx, commit) do
    io_result(
      Cache.write_ref(ctx.repo_dir, ctx.revision, commit),
      "could not record revision #{ctx.revision} of #{ctx.repo} in the cache #{ctx.repo_dir}"
    )
  end

  # A cache write's result, its failure an :io error saying what failed.
  defp io_result(:ok, _what), do: :ok

  defp io_result({:error, reason}, what) do
    {:error, Error.exception(kind: :io, message: "#{what}: #{:file.format_error(reason)}")}
  end

  ## From the cache

  defp from_cache(ctx, what, why) do
    commit =
      if ctx.revision =~ ~r/\A[0-9a-f]{40}\z/ do
        {:ok, ctx.revision}
      else
        Cache.read_ref(ctx.repo_dir, ctx.revision)
      end

    with {:ok, commit} <- commit,
         snapshot = Cache.snapshot_dir(ctx.repo_dir, commit),
         :ok <- complete(ctx, what, snapshot) do
      {:ok, in_subdir(ctx, snapshot)}
    else
      :error -> {:error, not_cached(ctx, why, nil)}
      {:missing, file} -> {:error, not_cached(ctx, why, file)}
    end
  end

  defp complete(ctx, what, snapshot) do
    present? = &File.regular?(Path.join(snapshot, &1))

    required =
      case what do
        :tokenizer ->
          ["tokenizer.json"]

        :checkpoint ->
          index = repo_path(ctx, @index)

          weights =
            if present?.(index) do
              case shards_of_index(ctx, Path.join(snapshot, index)) do
                {:ok, shards} -> shards
                {:error, _} -> [index]
              end
            else
              dir = Path.join(snapshot, ctx.subdir || "")

              case Path.wildcard(Path.join(dir, "model*.safetensors")) do
                [] -> [repo_path(ctx, "model.safetensors")]
                _ -> []
              end
            end

          [repo_path(ctx, "config.json") | weights]
      end

    case Enum.reject(required, present?) do
      [] -> :ok
      [file | _] -> {:missing, file}
    end
  end

  defp not_cached(ctx, why, file) do
    how =
      case why do
        "offline" -> "offline (offline: true or HF_HUB_OFFLINE=1)"
        _ -> "the Hub cannot be reached"
      end

    missing = if file, do: ": #{file} is missing", else: ""

    Error.exception(
      kind: :offline,
      message:
        "the Hugging Face repository #{ctx.repo} (revision #{ctx.revision}) is not in the " <>
          "cache #{ctx.cache_dir}#{missing}, and #{how}. Fetch it once with network access"
    )
  end

  defp repo_path(%{subdir: nil}, name), do: name
  defp repo_path(%{subdir: subdir}, name), do: subdir <> "/" <> name

  defp in_subdir(%{subdir: nil}, snapshot), do: snapshot
  defp in_subdir(%{subdir: subdir}, snapshot), do: Path.join(snapshot, subdir)
end

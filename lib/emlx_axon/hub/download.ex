defmodule EMLXAxon.Hub.Download do
  @moduledoc false
  # One file of a repository into the cache: reused when its blob (named by
  # ETag) is there, else streamed into `<blob>.part`, resumed with an HTTP
  # Range after a dropped connection, checked (size, sha256 or git blob id)
  # and renamed to its final name. A check that fails deletes the .part, so
  # the next try starts afresh instead of resuming bad bytes.

  require Logger

  alias EMLXAxon.{Error, Telemetry}
  alias EMLXAxon.Hub.{Cache, HTTP}

  @attempts 5
  @progress_interval_ms 250
  @chunk 1_048_576

  @typedoc """
  What the repository listing (or a HEAD request) says about a file; any
  field may be nil.
  """
  @type meta :: %{
          size: non_neg_integer() | nil,
          etag: String.t() | nil,
          sha256: String.t() | nil,
          blob_id: String.t() | nil
        }

  @doc false
  # Returns the path of the file's checked blob.
  @spec fetch(map(), String.t(), meta() | nil) ::
          {:ok, Path.t(), :cached | :downloaded} | {:error, Error.t()}
  def fetch(ctx, file, meta) do
    url = file_url(ctx, file)

    with {:ok, meta} <- complete_meta(ctx, file, url, meta) do
      blob = Cache.blob_path(ctx.repo_dir, meta.etag)

      if complete?(blob, meta) do
        {:ok, blob, :cached}
      else
        # One download of a blob at a time in this VM; a second caller
        # waits, then finds it complete.
        :global.trans(
          {{__MODULE__, blob}, self()},
          fn ->
            if complete?(blob, meta),
              do: {:ok, blob, :cached},
              else: download(ctx, file, url, meta, blob)
          end,
          [node()]
        )
      end
    end
  end

  @doc false
  @spec file_url(map(), String.t()) :: String.t()
  def file_url(ctx, file) do
    "#{ctx.endpoint}/#{ctx.repo}/resolve/#{encode(ctx.commit)}/#{encode_path(file)}"
  end

  @doc false
  @spec encode(String.t()) :: String.t()
  def encode(segment), do: URI.encode(segment, &URI.char_unreserved?/1)

  defp encode_path(path), do: path |> String.split("/") |> Enum.map_join("/", &encode/1)

  defp complete?(blob, meta) do
    case File.stat(blob) do
      {:ok, %File.Stat{type: :regular, size: size}} -> meta.size in [nil, size]
      _ -> false
    end
  end

  ## What the file is, when the listing did not say

  defp complete_meta(_ctx, _file, _url, %{etag: etag} = meta) when is_binary(etag),
    do: {:ok, meta}

  defp complete_meta(ctx, file, url, meta) do
    meta = meta || %{size: nil, etag: nil, sha256: nil, blob_id: nil}

    case HTTP.request(:head, url, auth_headers(ctx), follow: false) do
      {:ok, status, headers, _body} when status in 200..399 ->
        etag = etag(headers["x-linked-etag"] || headers["etag"])

        cond do
          etag != nil ->
            size = integer(headers["x-linked-size"] || headers["content-length"])
            sha256 = if etag =~ ~r/\A[0-9a-f]{64}\z/, do: etag

            {:ok, %{meta | etag: etag, size: meta.size || size, sha256: meta.sha256 || sha256}}

          status in 300..399 ->
            # A redirect without the file's ETag: ask where it leads.
            case HTTP.request(:head, url, auth_headers(ctx), follow: true) do
              {:ok, status, headers, _} when status in 200..299 ->
                etag =
                  etag(headers["etag"]) ||
                    Base.encode16(:crypto.hash(:sha256, "#{ctx.commit}/#{file}"), case: :lower)

                {:ok, %{meta | etag: etag, size: meta.size || integer(headers["content-length"])}}

              {:ok, status, headers, body} ->
                {:error, status_error(ctx, file, url, status, headers, body)}

              {:error, reason} ->
                {:error, network_error(ctx, file, url, reason, 1)}
            end

          true ->
            # No ETag at all: the blob is named by commit and file instead.
            name = Base.encode16(:crypto.hash(:sha256, "#{ctx.commit}/#{file}"), case: :lower)
            {:ok, %{meta | etag: name, size: meta.size || integer(headers["content-length"])}}
        end

      {:ok, status, headers, body} ->
        {:error, status_error(ctx, file, url, status, headers, body)}

      {:error, reason} ->
        {:error, network_error(ctx, file, url, reason, 1)}
    end
  end

  @doc false
  # An ETag without its quotes or weak prefix.
  @spec etag(String.t() | nil) :: String.t() | nil
  def etag(nil), do: nil

  def etag(value) do
    case value |> String.trim() |> String.replace_prefix("W/", "") |> String.trim("\"") do
      "" -> nil
      etag -> etag
    end
  end

  defp integer(nil), do: nil

  defp integer(value) do
    case Integer.parse(value) do
      {int, ""} when int >= 0 -> int
      _ -> nil
    end
  end

  ## Downloading

  defp download(ctx, file, url, meta, blob) do
    part = blob <> ".part"
    started = System.monotonic_time(:millisecond)
    telemetry_meta = %{repo: ctx.repo, revision: ctx.revision, file: file, size: meta.size}

    Telemetry.span([:emlx_axon, :hub, :download], telemetry_meta, fn ->
      result =
        with :ok <- mkdir(ctx, file, Path.dirname(blob)) do
          attempt(ctx, file, url, meta, part, blob, 1, 0)
        end

      case result do
        {:ok, transferred} ->
          seconds = (System.monotonic_time(:millisecond) - started) / 1000

          Logger.info(
            "Downloaded #{file} of #{ctx.repo} (#{human(File.stat!(blob).size)}, " <>
              "#{:erlang.float_to_binary(seconds, decimals: 1)} s) into #{ctx.repo_dir}"
          )

          {{:ok, blob, :downloaded}, %{bytes: transferred}, %{}}

        {:error, error} ->
          {{:error, error}, %{}, %{error: error}}
      end
    end)
  end

  defp mkdir(ctx, file, dir) do
    case File.mkdir_p(dir) do
      :ok -> :ok
      {:error, reason} -> {:error, io_error(ctx, file, dir, reason)}
    end
  end

  # `best` is the furthest the .part has got: an attempt that gets further
  # does not use up an attempt, so a long download over a flaky connection
  # goes on as long as it makes progress.
  defp attempt(ctx, file, url, meta, part, blob, n, best) do
    case attempt_once(ctx, file, url, meta, part) do
      {:done, state} ->
        finish(ctx, file, url, meta, part, blob, state, n, best)

      {:retry, reason, offset} ->
        retry(ctx, file, url, meta, part, blob, n, best, offset, reason)

      {:error, _} = error ->
        error
    end
  end

  defp retry(ctx, file, url, meta, part, blob, n, best, offset, reason) do
    {n, best} = if offset > best, do: {n, offset}, else: {n + 1, best}

    if n > @attempts do
      {:error, network_error(ctx, file, url, reason, @attempts, part)}
    else
      Logger.warning(
        "Download of #{file} of #{ctx.repo} interrupted (#{format_reason(reason)}) " <>
          "at #{human(offset)}; resuming"
      )

      Process.sleep(min(100 * Integer.pow(2, n - 1), 2_000))
      attempt(ctx, file, url, meta, part, blob, n, best)
    end
  end

  defp attempt_once(ctx, file, url, meta, part) do
    offset = part_offset(part, meta.size)

    case File.open(part, [:append, :binary, :raw]) do
      {:ok, fd} ->
        try do
          hashes = hash_existing(part, offset, meta)
          range = if offset > 0, do: [{"range", "bytes=#{offset}-"}], else: []
          headers = auth_headers(ctx) ++ range
          now = System.monotonic_time(:millisecond)

          state = %{
            ctx: ctx,
            file: file,
            meta: meta,
            fd: fd,
            offset: offset,
            transferred: 0,
            hashes: hashes,
            failure: nil,
            last_progress: now - @progress_interval_ms
          }

          case HTTP.stream(url, headers, ctx.idle_timeout, state, &on_stream/2) do
            {:done, state} ->
              :file.sync(fd)
              {:done, state}

            {:error, reason, state} ->
              {:retry, reason, state.offset}

            {:status, 416, _headers, _body} when offset > 0 ->
              # The .part is not a prefix the server can continue: start over.
              File.rm(part)
              {:retry, :range_not_satisfiable, 0}

            {:status, status, _headers, _body} when status == 429 or status >= 500 ->
              {:retry, {:http_status, status}, offset}

            {:status, status, headers, body} ->
              {:error, status_error(ctx, file, url, status, headers, body)}
          end
        after
          File.close(fd)
        end

      {:error, reason} ->
        {:error, io_error(ctx, file, part, reason)}
    end
  end

  defp on_stream(_event, %{failure: failure} = state) when failure != nil, do: state

  defp on_stream({:start, 206, headers}, state) do
    case Regex.run(~r/^bytes (\d+)-/, headers["content-range"] || "") do
      [_, start] ->
        if String.to_integer(start) == state.offset,
          do: progress(state, true),
          else: %{state | failure: :bad_range}

      nil ->
        %{state | failure: :bad_range}
    end
  end

  defp on_stream({:start, 200, _headers}, state) do
    # The whole file again (the server ignored the Range): start the .part over.
    state =
      if state.offset > 0 do
        {:ok, 0} = :file.position(state.fd, 0)
        :ok = :file.truncate(state.fd)
        %{state | offset: 0, hashes: new_hashes(state.meta)}
      else
        state
      end

    progress(state, true)
  end

  defp on_stream({:data, chunk}, state) do
    case :file.write(state.fd, chunk) do
      :ok ->
        size = byte_size(chunk)

        state = %{
          state
          | offset: state.offset + size,
            transferred: state.transferred + size,
            hashes: update_hashes(state.hashes, chunk)
        }

        progress(state, false)

      {:error, reason} ->
        %{state | failure: {:write, reason}}
    end
  end

  defp finish(ctx, file, url, meta, part, blob, state, n, best) do
    cond do
      state.failure == :bad_range ->
        File.rm(part)
        retry(ctx, file, url, meta, part, blob, n, best, 0, :bad_content_range)

      match?({:write, _}, state.failure) ->
        {:write, reason} = state.failure
        {:error, io_error(ctx, file, part, reason)}

      meta.size != nil and state.offset < meta.size ->
        # The body ended early without an error: resume it.
        retry(ctx, file, url, meta, part, blob, n, best, state.offset, :incomplete_body)

      true ->
        case verify(state, meta) do
          :ok ->
            progress(state, true)

            case File.rename(part, blob) do
              :ok -> {:ok, state.transferred}
              {:error, reason} -> {:error, io_error(ctx, file, blob, reason)}
            end

          {:error, what} ->
            File.rm(part)

            {:error,
             Error.exception(
               kind: :checksum,
               message:
                 "#{file} of the Hugging Face repository #{ctx.repo} (revision " <>
                   "#{ctx.revision}) failed its check: #{what}; the download was discarded " <>
                   "(from #{url})"
             )}
        end
    end
  end

  defp verify(state, meta) do
    cond do
      meta.size != nil and state.offset != meta.size ->
        {:error, "expected #{meta.size} bytes, got #{state.offset}"}

      meta.sha256 != nil ->
        actual = hex(:crypto.hash_final(state.hashes.sha256))
        expected = String.downcase(meta.sha256)

        if actual == expected,
          do: :ok,
          else: {:error, "expected sha256 #{expected}, got #{actual}"}

      state.hashes.git != nil ->
        actual = hex(:crypto.hash_final(state.hashes.git))
        expected = String.downcase(meta.blob_id)

        if actual == expected,
          do: :ok,
          else: {:error, "expected git blob id #{expected}, got #{actual}"}

      true ->
        :ok
    end
  end

  ## Hashes: sha256 (LFS files), or the git blob id (other files, when the
  ## listing gave it and the size, which the id's header holds)

  defp new_hashes(meta) do
    git =
      if meta.sha256 == nil and meta.blob_id != nil and meta.size != nil do
        :crypto.hash_init(:sha) |> :crypto.hash_update("blob #{meta.size}\0")
      end

    %{sha256: :crypto.hash_init(:sha256), git: git}
  end

  defp update_hashes(%{sha256: sha256, git: git}, data) do
    %{
      sha256: :crypto.hash_update(sha256, data),
      git: git && :crypto.hash_update(git, data)
    }
  end

  defp hash_existing(_part, 0, meta), do: new_hashes(meta)

  defp hash_existing(part, offset, meta) do
    part
    |> File.stream!([], @chunk)
    |> Enum.reduce({new_hashes(meta), 0}, fn chunk, {hashes, read} ->
      # Only the first `offset` bytes: part_offset/2 decided to keep them.
      keep = min(byte_size(chunk), offset - read)
      {update_hashes(hashes, binary_part(chunk, 0, keep)), read + keep}
    end)
    |> elem(0)
  end

  # How much of an earlier .part to keep: none when it is longer than the
  # file (then it is not this file's prefix).
  defp part_offset(part, size) do
    case File.stat(part) do
      {:ok, %File.Stat{type: :regular, size: part_size}} when size == nil or part_size <= size ->
        part_size

      {:ok, _} ->
        File.rm(part)
        0

      {:error, _} ->
        0
    end
  end

  defp hex(binary), do: Base.encode16(binary, case: :lower)

  ## Progress

  defp progress(state, force?) do
    now = System.monotonic_time(:millisecond)

    if force? or now - state.last_progress >= @progress_interval_ms do
      %{ctx: ctx, file: file, meta: meta, offset: bytes} = state

      event = %{
        repo: ctx.repo,
        revision: ctx.revision,
        file: file,
        bytes: bytes,
        total: meta.size
      }

      if ctx.progress, do: ctx.progress.(event)

      Telemetry.execute(
        [:emlx_axon, :hub, :download, :progress],
        %{bytes: bytes, total: meta.size},
        %{repo: ctx.repo, revision: ctx.revision, file: file}
      )

      %{state | last_progress: now}
    else
      state
    end
  end

  ## Errors

  @doc false
  @spec auth_headers(map()) :: [{String.t(), String.t()}]
  def auth_headers(ctx) do
    agent = [{"user-agent", "emlx_axon/#{ctx.version}; elixir/#{System.version()}"}]
    if ctx.token, do: [{"authorization", "Bearer #{ctx.token}"} | agent], else: agent
  end

  @doc false
  # The error for an HTTP answer other than success; `file` is nil for the
  # repository listing.
  @spec status_error(map(), String.t() | nil, String.t(), integer(), map(), binary()) ::
          Error.t()
  def status_error(ctx, file, url, status, headers, body) do
    what =
      if file,
        do: "#{file} of the Hugging Face repository #{ctx.repo}",
        else: "the Hugging Face repository #{ctx.repo}"

    where = "(revision #{ctx.revision}, #{url})"
    said = hub_said(headers, body)

    {kind, message} =
      case status do
        401 when ctx.token == nil ->
          {:unauthorized,
           "#{what} needs authorization #{where}: the Hub answered 401#{said}. The repository " <>
             "is private or gated, or does not exist; pass auth_token: (or set HF_TOKEN) " <>
             "with a token that can read it"}

        401 ->
          {:unauthorized,
           "#{what} could not be read with the token given #{where}: the Hub answered " <>
             "401#{said}. Check that the token (auth_token: or HF_TOKEN) is valid and can " <>
             "read the repository, and that the repository exists"}

        403 ->
          {:unauthorized,
           "access to #{what} was refused #{where}: the Hub answered 403#{said}. For a " <>
             "gated repository, accept its conditions on the Hub with the account of the token"}

        404 when file == nil ->
          {:not_found,
           "#{what} was not found #{where}: the Hub answered 404#{said}. Check the repository " <>
             "id and the revision"}

        404 ->
          {:not_found, "#{what} was not found #{where}: the Hub answered 404#{said}"}

        _ ->
          {:network,
           "#{what} could not be downloaded #{where}: the Hub answered #{status}#{said}"}
      end

    Error.exception(kind: kind, message: message)
  end

  defp hub_said(headers, body) do
    text =
      headers["x-error-message"] ||
        case EMLXAxon.JSON.Decoder.decode(body || "") do
          {:ok, %{"error" => error}} when is_binary(error) -> error
          _ -> nil
        end

    if text, do: " (#{String.slice(text, 0, 200)})", else: ""
  end

  @doc false
  @spec network_error(map(), String.t() | nil, String.t(), term(), pos_integer(), Path.t() | nil) ::
          Error.t()
  def network_error(ctx, file, url, reason, attempts, part \\ nil) do
    what =
      if file,
        do: "#{file} of the Hugging Face repository #{ctx.repo}",
        else: "the file list of the Hugging Face repository #{ctx.repo}"

    kept =
      case part && File.stat(part) do
        {:ok, %File.Stat{size: size}} when size > 0 ->
          "; the #{human(size)} downloaded so far are kept in #{part} and the next try resumes there"

        _ ->
          ""
      end

    tries = if attempts > 1, do: " (#{attempts} attempts)", else: ""

    Error.exception(
      kind: :network,
      message:
        "could not download #{what} (revision #{ctx.revision}) from #{url}: " <>
          "#{format_reason(reason)}#{tries}#{kept}"
    )
  end

  defp io_error(ctx, file, path, reason) do
    Error.exception(
      kind: :io,
      message:
        "could not write #{file} of the Hugging Face repository #{ctx.repo} to #{path}: " <>
          "#{:file.format_error(reason)}"
    )
  end

  defp format_reason(:socket_closed_remotely), do: "the connection was closed mid-transfer"
  defp format_reason(:timeout), do: "no data arrived for too long (timed out)"
  defp format_reason(:incomplete_body), do: "the body ended before the file's size"
  defp format_reason({:http_status, status}), do: "the server answered #{status}"

  defp format_reason({:failed_connect, [{:to_address, _}, {_, _, reason}]}),
    do: "could not connect (#{inspect(reason)})"

  defp format_reason(reason) when is_binary(reason), do: reason
  defp format_reason(reason), do: inspect(reason)

  @doc false
  @spec human(non_neg_integer()) :: String.t()
  def human(bytes) when bytes >= 1_073_741_824, do: "#{Float.round(bytes / 1_073_741_824, 2)} GiB"
  def human(bytes) when bytes >= 1_048_576, do: "#{Float.round(bytes / 1_048_576, 1)} MiB"
  def human(bytes) when bytes >= 1024, do: "#{Float.round(bytes / 1024, 1)} KiB"
  def human(bytes), do: "#{bytes} B"
end

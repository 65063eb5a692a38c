defmodule EMLXAxon.TestHub do
  @moduledoc false
  # A stand-in for the Hugging Face Hub, on 127.0.0.1 only, with the Hub's
  # URL layout and headers:
  #
  #   GET /api/models/{repo}[/revision/{rev}]   the listing: commit and siblings
  #                                             (blobId, size, lfs.sha256/size)
  #   GET|HEAD /{repo}/resolve/{rev}/{file}     small files: 200 with ETag (the
  #                                             git blob id); *.safetensors: 302
  #                                             to /cdn/{sha256} with X-Linked-Etag
  #                                             and X-Linked-Size, as the Hub's LFS
  #   GET /cdn/{sha256}                         the bytes, honouring Range
  #
  # Repositories may require a bearer token. Faults are set per file as a
  # list, one used up per request for the file's bytes: {:drop_after, bytes}
  # closes the connection after that many body bytes, :corrupt flips a byte
  # of the body, {:status, code} answers `code`. Every request is logged, so
  # tests can count them.

  @lfs_suffix ".safetensors"

  defstruct [:port, :url, :state, :acceptor]

  @doc "Starts a server on 127.0.0.1 with no repositories."
  def start! do
    {:ok, state} = Agent.start(fn -> %{repos: %{}, blobs: %{}, faults: %{}, requests: []} end)

    parent = self()

    acceptor =
      spawn(fn ->
        {:ok, listen} =
          :gen_tcp.listen(0, [
            :binary,
            ip: {127, 0, 0, 1},
            packet: :http_bin,
            active: false,
            reuseaddr: true,
            backlog: 128
          ])

        {:ok, port} = :inet.port(listen)
        send(parent, {:test_hub_port, self(), port})
        accept(listen, state, port)
      end)

    port =
      receive do
        {:test_hub_port, ^acceptor, port} -> port
      after
        5_000 -> raise "the test hub did not start"
      end

    %__MODULE__{port: port, url: "http://127.0.0.1:#{port}", state: state, acceptor: acceptor}
  end

  def stop(%__MODULE__{state: state, acceptor: acceptor}) do
    Process.exit(acceptor, :kill)
    if Process.alive?(state), do: Agent.stop(state)
    :ok
  end

  @checkpoint ~w(config.json generation_config.json model.safetensors model.safetensors.index.json
                 tokenizer.json tokenizer_config.json)

  @doc "The files of a checkpoint folder that a loader reads."
  def checkpoint_names, do: @checkpoint

  @doc "A checkpoint folder's files as `put_repo/4` takes them: `%{name => binary}`."
  def checkpoint_files(dir), do: Map.new(@checkpoint, &{&1, File.read!(Path.join(dir, &1))})

  @doc """
  Serves `files` (`%{name => binary}`, or a folder whose files are read) as
  repository `repo`. Options: `:token` (a bearer token the repository
  requires), `:commit` (its commit id), `:revisions` (names to commits,
  default `%{"main" => commit}`), `:cdn` (another server, holding the same
  repository, that *.safetensors redirects go to: another origin).
  """
  def put_repo(%__MODULE__{state: state}, repo, files, opts \\ []) do
    files =
      if is_binary(files) do
        for name <- File.ls!(files),
            path = Path.join(files, name),
            File.regular?(path),
            into: %{},
            do: {name, File.read!(path)}
      else
        files
      end

    commit = Keyword.get_lazy(opts, :commit, &random_commit/0)
    cdn = Keyword.get(opts, :cdn)
    revisions = Keyword.get(opts, :revisions, %{"main" => commit})

    entries =
      Map.new(files, fn {name, data} ->
        {name, %{data: data, sha256: sha256(data), blob_id: git_oid(data)}}
      end)

    Agent.update(state, fn s ->
      blobs = for {name, e} <- entries, into: s.blobs, do: {e.sha256, {repo, name, e.data}}
      # Earlier commits stay readable by their id, as on the Hub.
      commits = Map.put((s.repos[repo] || %{commits: %{}}).commits, commit, entries)

      repos =
        Map.put(s.repos, repo, %{
          commit: commit,
          revisions: revisions,
          token: opts[:token],
          cdn: cdn && cdn.url,
          commits: commits
        })

      %{s | repos: repos, blobs: blobs}
    end)

    commit
  end

  def put_faults(%__MODULE__{state: state}, repo, file, faults) when is_list(faults) do
    Agent.update(state, fn s -> %{s | faults: Map.put(s.faults, {repo, file}, faults)} end)
  end

  @doc "The requests served so far, oldest first: `%{method, path, range, authorization}`."
  def requests(%__MODULE__{state: state}),
    do: state |> Agent.get(& &1.requests) |> Enum.reverse()

  def clear_requests(%__MODULE__{state: state}),
    do: Agent.update(state, &%{&1 | requests: []})

  def commit(%__MODULE__{state: state}, repo), do: Agent.get(state, & &1.repos[repo].commit)

  def sha256(data), do: :crypto.hash(:sha256, data) |> Base.encode16(case: :lower)

  def git_oid(data),
    do: :crypto.hash(:sha, ["blob #{byte_size(data)}", 0, data]) |> Base.encode16(case: :lower)

  defp random_commit, do: :crypto.strong_rand_bytes(20) |> Base.encode16(case: :lower)

  ## Sharding

  @doc """
  Splits a safetensors file into `n` shards with an index, as
  transformers writes them: `%{"model-0000i-of-0000n.safetensors" => binary,
  "model.safetensors.index.json" => json}`.
  """
  def shard!(file, n) do
    <<len::little-64, header::binary-size(len), data::binary>> = File.read!(file)
    {:ok, header} = EMLXAxon.JSON.Decoder.decode(header)
    {metadata, tensors} = Map.pop(header, "__metadata__")
    # Split between layers, as the writers' size-ordered shards mostly
    # fall (a module's weight, scales and biases stay in one file).
    modules =
      tensors
      |> Enum.sort_by(fn {name, _} -> name end)
      |> Enum.chunk_by(fn {name, _} -> name |> String.split(".") |> Enum.take(3) end)

    per = div(length(modules) + n - 1, n)
    groups = modules |> Enum.chunk_every(per) |> Enum.map(&Enum.concat/1)
    count = length(groups)
    name = fn i -> "model-#{pad(i)}-of-#{pad(count)}.safetensors" end

    shards =
      groups
      |> Enum.with_index(1)
      |> Map.new(fn {group, i} ->
        {entries, {body, _}} =
          Enum.map_reduce(group, {[], 0}, fn {tensor, info}, {body, offset} ->
            [start, stop] = info["data_offsets"]
            bytes = binary_part(data, start, stop - start)
            size = byte_size(bytes)

            {{tensor, %{info | "data_offsets" => [offset, offset + size]}},
             {[body, bytes], offset + size}}
          end)

        header = Map.new(entries)
        header = if metadata, do: Map.put(header, "__metadata__", metadata), else: header
        json = EMLXAxon.JSON.encode!(header)
        # Data aligned to 8 bytes, as the safetensors writers do.
        json = json <> String.duplicate(" ", rem(8 - rem(byte_size(json), 8), 8))
        {name.(i), IO.iodata_to_binary([<<byte_size(json)::little-64>>, json, body])}
      end)

    weight_map =
      for {group, i} <- Enum.with_index(groups, 1), {tensor, _} <- group, into: %{} do
        {tensor, name.(i)}
      end

    index =
      EMLXAxon.JSON.encode!(%{metadata: %{total_size: byte_size(data)}, weight_map: weight_map})

    Map.put(shards, "model.safetensors.index.json", index)
  end

  defp pad(i), do: i |> Integer.to_string() |> String.pad_leading(5, "0")

  ## Serving

  defp accept(listen, state, port) do
    case :gen_tcp.accept(listen) do
      {:ok, socket} ->
        pid = spawn(fn -> serve(socket, state, port) end)
        :ok = :gen_tcp.controlling_process(socket, pid)
        send(pid, :go)
        accept(listen, state, port)

      {:error, _} ->
        :ok
    end
  end

  defp serve(socket, state, port) do
    receive do
      :go -> :ok
    end

    with {:ok, method, path, headers} <- read_request(socket, nil, nil, %{}) do
      request = %{
        method: method,
        path: path,
        range: headers["range"],
        authorization: headers["authorization"]
      }

      Agent.update(state, &%{&1 | requests: [request | &1.requests]})
      :inet.setopts(socket, packet: :raw)
      respond(socket, state, port, method, path, headers)
    end

    :gen_tcp.close(socket)
  end

  defp read_request(socket, method, path, headers) do
    case :gen_tcp.recv(socket, 0, 10_000) do
      {:ok, {:http_request, method, {:abs_path, path}, _version}} ->
        read_request(socket, to_string(method), path, headers)

      {:ok, {:http_header, _, name, _, value}} ->
        name = name |> to_string() |> String.downcase()
        read_request(socket, method, path, Map.put(headers, name, value))

      {:ok, :http_eoh} ->
        {:ok, method, path, headers}

      _ ->
        :error
    end
  end

  defp respond(socket, state, port, method, raw_path, headers) do
    [path | _] = String.split(raw_path, "?", parts: 2)
    segments = path |> String.split("/") |> tl() |> Enum.map(&URI.decode/1)
    s = Agent.get(state, & &1)

    case segments do
      ["api", "models" | rest] ->
        {repo, revision} =
          case Enum.split_while(rest, &(&1 != "revision")) do
            {repo, ["revision", revision]} -> {Enum.join(repo, "/"), revision}
            {repo, []} -> {Enum.join(repo, "/"), "main"}
          end

        with {:ok, entry} <- repo_entry(s, repo, headers),
             {:ok, commit} <- commit_of(entry, revision) do
          send_response(
            socket,
            200,
            [{"content-type", "application/json"}],
            listing(repo, entry, commit)
          )
        else
          {:error, status, error_headers, body} ->
            send_response(socket, status, error_headers, body)
        end

      ["cdn", sha] ->
        case s.blobs[sha] do
          {repo, name, data} ->
            send_file(socket, state, {repo, name}, method, data, headers, [])

          nil ->
            send_response(socket, 404, [], "no such blob")
        end

      _ ->
        case Enum.split_while(segments, &(&1 != "resolve")) do
          {repo_parts, ["resolve", revision | file_parts]}
          when repo_parts != [] and file_parts != [] ->
            repo = Enum.join(repo_parts, "/")
            name = Enum.join(file_parts, "/")
            resolve(socket, state, port, s, method, repo, revision, name, headers)

          _ ->
            send_response(socket, 404, [], "not found")
        end
    end
  end

  defp resolve(socket, state, port, s, method, repo, revision, name, headers) do
    with {:ok, entry} <- repo_entry(s, repo, headers),
         {:ok, commit} <- commit_of(entry, revision),
         {:ok, file} <- file_of(entry, commit, name) do
      common = [{"x-repo-commit", commit}]

      if String.ends_with?(name, @lfs_suffix) do
        location = "#{entry.cdn || "http://127.0.0.1:#{port}"}/cdn/#{file.sha256}"

        send_response(
          socket,
          302,
          common ++
            [
              {"location", location},
              {"x-linked-etag", ~s("#{file.sha256}")},
              {"x-linked-size", Integer.to_string(byte_size(file.data))},
              {"etag", ~s("#{git_oid("pointer " <> file.sha256)}")}
            ],
          ""
        )
      else
        extra = common ++ [{"etag", ~s("#{file.blob_id}")}]
        send_file(socket, state, {repo, name}, method, file.data, headers, extra)
      end
    else
      {:error, status, error_headers, body} -> send_response(socket, status, error_headers, body)
    end
  end

  defp repo_entry(s, repo, headers) do
    case s.repos[repo] do
      nil ->
        not_found("RepoNotFound", "Repository not found")

      %{token: token} = entry when token != nil ->
        if headers["authorization"] == "Bearer #{token}" do
          {:ok, entry}
        else
          {:error, 401, [{"x-error-code", "RepoNotFound"}, {"content-type", "application/json"}],
           ~s({"error":"Invalid username or password."})}
        end

      entry ->
        {:ok, entry}
    end
  end

  defp commit_of(entry, revision) do
    cond do
      commit = entry.revisions[revision] -> {:ok, commit}
      Map.has_key?(entry.commits, revision) -> {:ok, revision}
      true -> not_found("RevisionNotFound", "Invalid rev id: #{revision}")
    end
  end

  defp file_of(entry, commit, name) do
    case entry.commits[commit][name] do
      nil -> not_found("EntryNotFound", "Entry not found")
      file -> {:ok, file}
    end
  end

  defp not_found(code, message) do
    {:error, 404, [{"x-error-code", code}, {"content-type", "application/json"}],
     ~s({"error":"#{message}"})}
  end

  defp listing(repo, entry, commit) do
    siblings =
      entry.commits[commit]
      |> Enum.sort()
      |> Enum.map(fn {name, file} ->
        size = byte_size(file.data)
        sibling = %{rfilename: name, size: size, blobId: file.blob_id}

        if String.ends_with?(name, @lfs_suffix) do
          Map.put(sibling, :lfs, %{sha256: file.sha256, size: size, pointerSize: 134})
        else
          sibling
        end
      end)

    EMLXAxon.JSON.encode!(%{
      id: repo,
      sha: commit,
      private: entry.token != nil,
      siblings: siblings
    })
  end

  defp send_file(socket, state, key, method, data, headers, extra) do
    fault = take_fault(state, key)
    size = byte_size(data)

    data =
      case fault do
        :corrupt ->
          <<first, rest::binary>> = data
          <<Bitwise.bxor(first, 1), rest::binary>>

        _ ->
          data
      end

    {status, body, range_headers} =
      case Regex.run(~r/^bytes=(\d+)-$/, headers["range"] || "") do
        [_, start] ->
          start = String.to_integer(start)

          if start >= size do
            {416, "", [{"content-range", "bytes */#{size}"}]}
          else
            {206, binary_part(data, start, size - start),
             [{"content-range", "bytes #{start}-#{size - 1}/#{size}"}]}
          end

        nil ->
          {200, data, []}
      end

    extra = extra ++ range_headers ++ [{"accept-ranges", "bytes"}]

    case fault do
      {:status, code} ->
        send_response(socket, code, [], "injected failure")

      {:drop_after, bytes} when status in [200, 206] and method == "GET" ->
        head(socket, status, extra ++ [{"content-length", Integer.to_string(byte_size(body))}])
        :gen_tcp.send(socket, binary_part(body, 0, min(bytes, byte_size(body))))

      _ when method == "HEAD" ->
        head(socket, status, extra ++ [{"content-length", Integer.to_string(byte_size(body))}])

      _ ->
        send_response(socket, status, extra, body)
    end
  end

  # Takes the file's next fault, if it has one left.
  defp take_fault(state, key) do
    Agent.get_and_update(state, fn s ->
      case s.faults[key] do
        [fault | rest] -> {fault, put_in(s.faults[key], rest)}
        _ -> {nil, s}
      end
    end)
  end

  defp send_response(socket, status, headers, body) do
    head(socket, status, headers ++ [{"content-length", Integer.to_string(byte_size(body))}])
    :gen_tcp.send(socket, body)
  end

  defp head(socket, status, headers) do
    lines = for {name, value} <- headers, do: [name, ": ", value, "\r\n"]

    :gen_tcp.send(socket, [
      "HTTP/1.1 #{status} #{reason(status)}\r\n",
      lines,
      "connection: close\r\n\r\n"
    ])
  end

  defp reason(200), do: "OK"
  defp reason(206), do: "Partial Content"
  defp reason(302), do: "Found"
  defp reason(401), do: "Unauthorized"
  defp reason(403), do: "Forbidden"
  defp reason(404), do: "Not Found"
  defp reason(416), do: "Range Not Satisfiable"
  defp reason(_), do: "Status"
end
